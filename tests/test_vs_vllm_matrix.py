"""The pure parts of `benchmarks/vs_vllm.py --matrix`: shapes, the cells' verdicts, the random Qwen3's size.
No server starts here."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    path = list(sys.path)
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the matrix module imports vs_vllm by name
    spec.loader.exec_module(module)
    sys.path[:] = path  # the matrix module puts benchmarks/ first: not for the other tests
    return module


base = _load("vs_vllm")
matrix = _load("vs_vllm_matrix")


def test_shapes_parse_and_bad_ones_are_named():
    assert matrix.parse_shapes(matrix.DEFAULT_SHAPES) == [matrix.Shape(128, 64), matrix.Shape(256, 32),
                                                          matrix.Shape(1024, 128)]
    assert [str(s) for s in matrix.parse_shapes(" 128/64, 1024/128")] == ["128/64", "1024/128"]
    for bad in ("128x64", "0/5", "128/0", "128/", "-1/5", "1/2/3", "a/b"):
        with pytest.raises(ValueError, match=f"`{bad}` is not a shape"):
            matrix.parse_shapes(f"256/32,{bad}")
    with pytest.raises(ValueError, match="repeats"):
        matrix.parse_shapes("128/64,128/64")


def test_models_parse():
    assert matrix.parse_models("qwen3-100m,embedded,embedded") == ["qwen3-100m", "embedded"]
    with pytest.raises(ValueError, match="`llama` is not a matrix model. Accepted: embedded, qwen3-100m"):
        matrix.parse_models("embedded,llama")


def _summary(tok_s: float, ttft: float, tokens: int = 1024, expected: int = 1024) -> dict:
    return {"tpot_ms": 2.0, "ttft_ms": ttft, "itl_ms": 2.0, "output_tok_s": tok_s, "output_tokens": tokens,
            "expected_tokens": expected, "failed": 0}


def test_cell_verdicts_from_summaries():
    shape = matrix.Shape(128, 64)
    met = matrix.cell("embedded", shape, 8, [_summary(500, 10.0)], [_summary(500, 10.0)])
    assert met.ratio == 1.0 and matrix.misses(met) == {}  # equal is met: "at least", "no worse"
    slow = matrix.cell("embedded", shape, 8, [_summary(495, 9.0)], [_summary(500, 10.0)])
    assert matrix.misses(slow) == {"tok/s": "0.99x"}
    late = matrix.cell("qwen3-100m", shape, 32, [_summary(600, 10.2)], [_summary(500, 10.0)])
    assert matrix.misses(late) == {"TTFT": "10.2 vs 10.0 ms"}
    lines = matrix.verdict_lines([met, slow, late])
    assert lines[0] == "output tokens/s >= 1.0x vLLM's: missed in 1 of 3 cells: embedded 128/64 c8 (0.99x)"
    assert lines[1] == "median TTFT <= vLLM's: missed in 1 of 3 cells: qwen3-100m 128/64 c32 (10.2 vs 10.0 ms)"
    assert len(lines) == 2  # every token count equal
    short = matrix.cell("embedded", shape, 1, [_summary(500, 1.0, tokens=1000)], [_summary(400, 2.0)])
    assert matrix.verdict_lines([short]) == ["output tokens/s >= 1.0x vLLM's: met in every cell (1)",
                                             "median TTFT <= vLLM's: met in every cell (1)",
                                             "token counts differ from prompts x new tokens in: embedded 128/64 c1"]


def test_cell_takes_the_median_over_rounds():
    mine = [_summary(400, 30.0), _summary(600, 10.0), _summary(500, 20.0)]
    theirs = [_summary(500, 10.0), _summary(500, 10.0), _summary(250, 40.0)]
    c = matrix.cell("embedded", matrix.Shape(256, 32), 1, mine, theirs)
    assert c.hetserve["output_tok_s"] == 500 and c.vllm["ttft_ms"] == 10.0
    assert c.ratio == pytest.approx(1.2)  # the rounds' ratios 0.8, 1.2, 2.0: their median
    assert matrix.misses(c) == {"TTFT": "20.0 vs 10.0 ms"}


def test_random_qwen3_is_about_100m_parameters_and_shares_the_tokenizer():
    count = matrix.qwen3_param_count(matrix.QWEN3_100M)
    assert 90e6 <= count <= 110e6
    embedded = json.loads((matrix.EMBEDDED / "config.json").read_text())
    assert matrix.QWEN3_100M["vocab_size"] == embedded["vocab_size"]
    for name in matrix.TOKENIZER_FILES:
        assert (matrix.EMBEDDED / name).is_file()


def test_param_arithmetic_matches_transformers_on_the_meta_device():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for config in (matrix.QWEN3_100M, {**matrix.QWEN3_100M, "tie_word_embeddings": False, "attention_bias": True,
                                       "num_hidden_layers": 2, "head_dim": 128}):
        with torch.device("meta"):  # shapes only: no memory for the weights
            model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config))
        assert matrix.qwen3_param_count(config) == sum(p.numel() for p in model.parameters())


def test_max_model_len_covers_the_longest_shape():
    assert base.max_model_len(128 + 64) == 512  # the single-shape default stays vLLM's earlier 512
    assert base.max_model_len(1024 + 128) == 1280
    assert base.max_model_len(448) == 512 and base.max_model_len(449) == 768


def test_a_short_context_is_served_from_a_longer_copy(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"max_position_embeddings": 512, "rope_scaling": None}))
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    (src / "model.safetensors").write_bytes(b"weights")
    assert matrix.with_context(src, 512, tmp_path / "copy") == (src, "")
    model, note = matrix.with_context(src, 1280, tmp_path / "copy")
    assert model == tmp_path / "copy" and "512 < 1280" in note
    assert json.loads((model / "config.json").read_text())["max_position_embeddings"] == 1280
    assert json.loads((model / "tokenizer_config.json").read_text())["model_max_length"] == 1280
    assert (model / "model.safetensors").read_bytes() == b"weights"
    (src / "config.json").write_text(json.dumps({"max_position_embeddings": 512,
                                                 "rope_scaling": {"rope_type": "yarn", "factor": 4}}))
    with pytest.raises(SystemExit, match="only a default rotary"):
        matrix.with_context(src, 1280, tmp_path / "copy2")


def test_embedded_params_from_the_safetensors_header():
    config = json.loads((matrix.EMBEDDED / "config.json").read_text())
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    layers = config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # llama: q, o; k, v; the MLP; two norms
    assert matrix.safetensors_params(matrix.EMBEDDED) == layers * per_layer + v * h + h


def test_every_round_and_cell_sends_prompts_of_its_own_to_both_servers(monkeypatch, tmp_path):
    """Guards the per-round, per-cell `seed` in `run_model`: with one seed for all, a later cell or
    round would send prompts an earlier one left in both servers' prefix caches; both servers of a
    cell get the same prompts."""
    from types import SimpleNamespace

    sent = []

    def fake_bench(vllm, server, model, c, args, stopping, out_dir, extra=()):
        sent.append((server.name, args.seed, args.input_len, c))
        return {"median_tpot_ms": 1, "median_ttft_ms": 1, "median_itl_ms": 1, "output_throughput": 1,
                "total_output_tokens": 1, "expected_output_tokens": 1}

    started = lambda kind, *a, **k: SimpleNamespace(name=kind, url="", ready_s=1.0, stop=lambda: None)  # noqa: E731
    monkeypatch.setattr(matrix.base, "start", started)
    monkeypatch.setattr(matrix.base, "stopping_for", lambda url, model: ([], "none"))
    monkeypatch.setattr(matrix.base, "bench", fake_bench)
    shapes = [matrix.Shape(128, 64), matrix.Shape(256, 32)]
    args = SimpleNamespace(seed=7, rounds=2, port=9000)
    matrix.run_model("m", tmp_path, tmp_path, "hetserve", shapes, [1, 8], args, tmp_path, 512)
    assert len(sent) == 2 * 2 * 2 * 2  # rounds x shapes x concurrencies x servers
    by_seed = {}
    for name, seed, length, c in sent:
        by_seed.setdefault(seed, set()).add((name, length, c))
    assert len(by_seed) == 2 * 2 * 2  # one seed per round and cell
    assert all({name for name, _, _ in runs} == {"vllm", "hetserve"} and len({(n, c) for _, n, c in runs}) == 1
               for runs in by_seed.values())  # both servers of a cell, the same prompts
