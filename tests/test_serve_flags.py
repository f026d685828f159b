"""`--served-model-name`, `--max-model-len` and `--gpu-memory-utilization`: checked once in the
router (server/config/models.py, server/config/memory.py), carried to every worker
(server/fleet/spec.py) and applied there (workers/kv/sizing.py, workers/engine/build.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from server.cli import build_parser
from server.config.settings import RouterSettings
from server.errors import UsageError
from tests.router_harness import ROOT, running_router
from workers.contract import DEFAULT_MODEL_DIR, simulated_device
from workers.kv.sizing import kv_budget


def _settings(*argv: str) -> RouterSettings:
    return RouterSettings.from_args(build_parser().parse_args(["serve", *argv]))


def _context_of(model: Path) -> int:
    return json.loads((model / "config.json").read_text())["max_position_embeddings"]


def test_served_model_name_renames_the_bare_model_and_the_embedded_one(tmp_path):
    """Guards `_served_name` in server/config/models.py: the bare `--model DIR` takes the name,
    named models keep theirs, and without --model the embedded model is served under it."""
    for name in ("3a1b2c4d5e", "other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text((DEFAULT_MODEL_DIR / "config.json").read_text())
    s = _settings("--model", str(tmp_path / "3a1b2c4d5e"), "--model", f"b={tmp_path / 'other'}",
                  "--served-model-name", "llama-chat")
    assert [e.name for e in s.models.entries] == ["llama-chat", "b"]
    assert s.model_name == "llama-chat" and s.model_dir == (tmp_path / "3a1b2c4d5e").resolve()
    embedded = _settings("--served-model-name", "tiny")
    assert embedded.model_name == "tiny" and embedded.model_dir == DEFAULT_MODEL_DIR


@pytest.mark.parametrize("argv, needle", [
    (["--model", "a={a}", "--model", "b={b}"], "holds 0"),
    (["--model", "{a}", "--model", "{b}"], "holds 2"),
    (["--models-dir", "{root}"], "`--models-dir"),
])
def test_served_model_name_with_no_single_bare_model_is_refused(tmp_path, argv, needle):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text((DEFAULT_MODEL_DIR / "config.json").read_text())
    argv = [v.format(a=tmp_path / "a", b=tmp_path / "b", root=tmp_path) for v in argv]
    with pytest.raises(UsageError) as e:
        _settings(*argv, "--served-model-name", "x")
    assert "`--served-model-name x`" in str(e.value) and needle in str(e.value)


def test_max_model_len_over_the_checkpoint_exits_2_before_any_worker(tmp_path):
    """Guards `max_model_len_from_args`'s `value > context` in server/config/memory.py."""
    context = _context_of(DEFAULT_MODEL_DIR)
    r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--simulate", "sm_80", "--port", "0",
                        "--max-model-len", str(context + 1)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert f"`--max-model-len {context + 1}` is longer than model `{DEFAULT_MODEL_DIR.name}`'s context length " \
           f"{context}" in r.stderr
    assert f"Accepted: 1-{context}" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert _settings("--max-model-len", str(context)).max_model_len == context


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2"])
def test_gpu_memory_utilization_outside_0_1_is_refused(value):
    with pytest.raises(UsageError, match=r"`--gpu-memory-utilization .*` is not a fraction.*0 < F <= 1"):
        _settings("--gpu-memory-utilization", value)


def test_fraction_budget_follows_each_simulated_devices_memory():
    """Guards `_fraction_budget` in workers/kv/sizing.py: F x the simulated memory less the weights,
    capped by --kv-cache-bytes; a share below the weights is a named error."""
    small, big = (SimpleNamespace(is_real_gpu=False, simulated=True, memory_total_bytes=d.memory_total_bytes)
                  for d in (simulated_device("sm_80:16GiB", 0), simulated_device("sm_90:80GiB", 1)))
    args = SimpleNamespace(gpu_memory_utilization=0.5, kv_cache_bytes=None, max_batch=4)
    assert kv_budget(args, small, 64, 128, weights_bytes=10**6)[0] == 8 * 2**30 - 10**6
    assert kv_budget(args, big, 64, 128, weights_bytes=10**6)[0] == 40 * 2**30 - 10**6
    capped = SimpleNamespace(gpu_memory_utilization=0.5, kv_cache_bytes=4096, max_batch=4)
    assert kv_budget(capped, big, 64, 128, weights_bytes=10**6)[0] == 4096
    tiny = SimpleNamespace(gpu_memory_utilization=1e-9, kv_cache_bytes=None, max_batch=4)
    with pytest.raises(ValueError, match=r"`--gpu-memory-utilization 1e-09`.*below the 1000000 bytes"):
        kv_budget(tiny, small, 64, 128, weights_bytes=10**6)


@pytest.mark.slow
def test_the_flags_through_a_real_serve(tmp_path_factory):
    """A real `hetserve serve` with two simulated devices of 16 and 80 GiB: /v1/models lists the
    served name with the capped context, and each worker's KV budget is its own device's share."""
    from tests.checkpoints import make_checkpoint

    model = make_checkpoint(tmp_path_factory.mktemp("flags") / "3a1b2c4d5e")
    assert _context_of(model) > 64
    gen = running_router(["--simulate", "sm_80:16GiB,sm_90:80GiB", "--model", str(model), "--max-batch", "2",
                          "--served-model-name", "chat", "--max-model-len", "64",
                          "--gpu-memory-utilization", "0.002"], fake=False, ready_timeout=240)
    router = next(gen)
    try:
        with router.client(timeout=60) as c:
            models = c.get("/v1/models").json()["data"]
            assert [(m["id"], m["context_length"]) for m in models] == [("chat", 64)]
            r = c.post("/v1/completions", json={"model": "chat", "prompt": "Hello", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "chat", r.text
            workers = c.get("/workers").json()["workers"]
        kv = {w["id"]: w["capacity"]["kv_cache_bytes"] for w in workers}
        assert {w["model"]["name"] for w in workers} == {"chat"}
        # 0.2% of 16 GiB is about 34 MB and of 80 GiB about 172 MB, less the same weights each; the pool
        # rounds down to whole blocks
        assert 30e6 < kv["gpu0"] < 34.4e6 and 160e6 < kv["gpu1"] < 171.8e6, kv
    finally:
        next(gen, None)
