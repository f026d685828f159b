"""benchmarks/decode_vs_transformers.py's command line and checkpoints, without timing anything.

`--arch` takes every family of the registry that has a checkpoint case (or `all`) and refuses
any other name with a message that names it and lists the supported ones; each family's benchmark-sized config
(tests/family_checkpoints.py `bench_config`) is the benchmark's size with the family's options
on, sized so they matter over the benchmark's sequences. Performance never goes in a unit test.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.family_checkpoints import BENCH, BENCH_ORIGINAL, BENCH_WINDOW, CASES, bench_config
from workers.model.config import ModelConfig
from workers.model.families.registry import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKED = sorted(set(FAMILIES) & set(CASES))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("decode_vs_transformers",
                                                  ROOT / "benchmarks/decode_vs_transformers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arch_defaults_to_llama_and_takes_every_family(bench):
    assert bench.parse_args([]).arch == ["llama"]
    assert bench.parse_args(["--arch", "all"]).arch == [f for f in FAMILIES if f == "llama" or f in CASES]
    assert bench.parse_args(["--arch", "phi3", "qwen3", "phi3"]).arch == ["qwen3", "phi3"]  # registry order, once


def test_unknown_arch_is_refused_with_the_supported_list(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--arch", "qwen3", "gpt2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "`gpt2` is not in the registry" in err
    for name in (*BENCHMARKED, "all"):
        assert name in err


@pytest.mark.parametrize("case", BENCHMARKED)
def test_bench_config_is_benchmark_sized_with_the_family_options(case, bench):
    transformers = pytest.importorskip("transformers")
    model_type, options = bench_config(case)
    assert model_type == CASES[case][0]
    cfg = transformers.AutoConfig.for_model(model_type, **options).to_dict()
    ours = ModelConfig.from_hf_config({**cfg, "architectures": None})
    assert ours.architecture == case
    assert (ours.hidden_size, ours.num_hidden_layers, ours.vocab_size) == (256, 4, 4096)
    assert ours.head_dim == BENCH["head_dim"]
    prompt = bench.parse_args([]).prompt_len
    windows = {ours.layer(i).sliding_window for i in range(ours.num_hidden_layers)} - {None}
    assert windows <= {BENCH_WINDOW} and BENCH_WINDOW < prompt
    if case in ("mistral", "qwen2", "qwen3", "gemma2", "gemma3", "smollm3", "olmo3"):
        assert windows, "the family's sliding layers are on"
    if case == "phi3":
        spec = ours.layer(0).rope
        assert spec.rope_type == "longrope" and spec.rotary_dim == BENCH["head_dim"] // 2
        assert spec.threshold == BENCH_ORIGINAL < prompt  # the long factors apply from the prompt on
    if case == "gemma2":
        assert ours.attn_softcap is not None and ours.final_softcap is not None


def test_bench_config_refuses_an_unknown_case():
    with pytest.raises(KeyError, match="`nope`"):
        bench_config("nope")


def test_a_family_without_a_checkpoint_case_is_refused_by_name(bench, monkeypatch):
    monkeypatch.delitem(CASES, "phi3")
    with pytest.raises(ValueError, match="`phi3` has no checkpoint case") as exc:
        bench.arch_names(["phi3"])
    assert "qwen3" in str(exc.value) and "phi3," not in str(exc.value)
    assert "phi3" not in bench.arch_names(["all"])
