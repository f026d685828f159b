"""`hetserve plan`: every device gets a kernel for every layer and the fp8 convention with
reasons, in `/workers`' field names, from the same decision code the workers run."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import server.commands.inventory
from kernels_local.mapping import LAYERS
from server.cli import main
from workers.contract import simulated_device

ROOT = Path(__file__).resolve().parents[1]
SPEC = "sm_75,sm_80,sm_89,sm_90,sm_100,sm_120"


def _plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_device_gets_every_layer_and_native_fp8_exactly_from_sm89(capsys):
    plan = _plan_json(capsys, "--simulate", SPEC)
    caps = [d["device"]["capability"] for d in plan["devices"]]
    assert caps == ["7.5", "8.0", "8.9", "9.0", "10.0", "12.0"]
    for entry in plan["devices"]:
        assert set(entry["kernels"]) == set(LAYERS)
        for k in entry["kernels"].values():
            assert set(k) == {"repo", "layer", "variant", "reason"} and all(k.values())
        native = entry["fp8"]["convention"] == "native_e4m3"
        assert native == (tuple(map(int, entry["device"]["capability"].split("."))) >= (8, 9))
        assert entry["kernels"]["Fp8Linear"]["variant"].startswith(entry["fp8"]["convention"])
        assert entry["fp8"]["reason"]


def test_field_names_match_workers(capsys):
    entry = _plan_json(capsys, "--simulate", "sm_90")["devices"][0]
    assert set(entry) == {"device", "fp8", "kernels"}
    assert set(entry["device"]) == {
        "type",
        "index",
        "uuid",
        "name",
        "capability",
        "simulated",
        "memory_total_bytes",
    }
    assert set(entry["fp8"]) == {"convention", "reason"}
    assert entry["device"]["simulated"] is True and entry["device"]["type"] == "cuda"


def test_plan_equals_what_the_worker_kernelizes_with(capsys):
    """The same selection code: a worker bound to the simulated device reports these kernels."""
    import torch

    from workers.device.bind import BoundDevice
    from workers.kernelize.apply import kernelize_for_device
    from workers.model.config import ModelConfig
    from workers.model.transformer import Transformer

    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)  # fmt: skip
    for entry in _plan_json(capsys, "--simulate", "sm_80,gfx942,cpu")["devices"]:
        d = entry["device"]
        cap = None if d["capability"] is None else tuple(map(int, d["capability"].split(".")))
        bound = BoundDevice(d["type"], d["index"], d["uuid"], d["name"], cap, d["memory_total_bytes"], True)
        chosen = kernelize_for_device(Transformer.random(cfg, torch.float32), bound)
        assert {k: v.to_dict() for k, v in chosen.items()} == entry["kernels"]


def test_without_simulate_uses_the_nvml_inventory(monkeypatch, capsys):
    gpus = [simulated_device("sm_80", 0), simulated_device("sm_90", 1)]
    gpus = [
        g.__class__(**{**g.__dict__, "simulated": False, "name": g.name.replace(" (simulated)", "")})
        for g in gpus
    ]
    monkeypatch.setattr(server.commands.inventory, "nvml_inventory", lambda: gpus)
    plan = _plan_json(capsys)
    assert [e["device"]["name"] for e in plan["devices"]] == [
        "NVIDIA A100-SXM4-80GB",
        "NVIDIA H100 80GB HBM3",
    ]
    assert plan["devices"][1]["kernels"]["RMSNorm"]["variant"] == "triton-sm90"
    assert _plan_json(capsys, "--devices", "1")["devices"][0]["device"]["index"] == 1


def test_without_gpus_plans_one_cpu_device(monkeypatch, capsys):
    monkeypatch.setattr(server.commands.inventory, "nvml_inventory", lambda: [])
    (entry,) = _plan_json(capsys)["devices"]
    assert entry["device"]["type"] == "cpu" and entry["device"]["capability"] is None
    assert entry["fp8"]["convention"] == "emulated"
    # the pre-quantized fp8 checkpoints' layer runs dequantized on a CPU
    # and the 4-bit checkpoints' layer keeps its packed weights (torch); the norm and the activation in C++
    assert {k["variant"] for k in entry["kernels"].values()} == {"torch", "emulated-torch", "dequantized-torch",
                                                                 "packed-torch", "cpp"}


def test_human_readable_table(capsys):
    assert main(["plan", "--simulate", "sm_89,gfx942"]) == 0
    out = capsys.readouterr().out
    assert "device 0: NVIDIA L40S (simulated) [cuda, capability 8.9, simulated]" in out
    assert "device 1: AMD Instinct MI300X (simulated) [rocm, capability 9.4, simulated]" in out
    for layer in ("fp8", *LAYERS):
        assert out.count(f"\n  {layer} ") == 2
    assert "kernels_local/fp8_linear:Fp8LinearTritonNativeSm89" in out


@pytest.mark.parametrize("argv", [["--simulate", "sm_x"], ["--simulate", "sm_80", "--devices", "5"]])
def test_bad_input_is_a_usage_error(capsys, argv):
    assert main(["plan", *argv]) == 2
    assert "hetserve plan: error:" in capsys.readouterr().err


def test_plan_loads_no_weights_and_initializes_no_cuda():
    code = textwrap.dedent(
        f"""
        import sys
        from server.cli import main
        assert main(["plan", "--simulate", "{SPEC}", "--json"]) == 0
        loaded = [m for m in ("workers.model.loader", "workers.model.transformer", "safetensors") if m in sys.modules]
        assert not loaded, loaded
        import torch
        assert not torch.cuda.is_initialized()
        """
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_plan_with_a_model_shows_each_layer_types_attention_per_device(capsys, tmp_path):
    """`plan --model DIR` on a Gemma 2 checkpoint (alternating sliding and full layers, soft-capped
    scores, its own norm and activation): per device, the decode kernel of each layer type
    told its window and cap, the prefill path, what the KV cache keeps, and the kernel layers
    the model does not use, from the workers' own reading of config.json."""
    from tests.family_checkpoints import make_family_checkpoint

    path = make_family_checkpoint("gemma2", tmp_path / "g2")
    plan = _plan_json(capsys, "--simulate", "cpu,sm_90", "--model", str(path))
    assert plan["model"]["architecture"] == "gemma2" and plan["model"]["features"]["attn_softcap"] == 20.0
    cpu, h100 = plan["devices"]
    for entry, variant in ((cpu, "torch"), (h100, "triton-sm90")):
        full, sliding = entry["attention"]
        assert (full["type"], full["window"], full["layers"]) == ("full", None, [1, 3])
        assert (sliding["type"], sliding["window"], sliding["layers"]) == ("sliding", 16, [0, 2])
        assert full["decode"]["variant"] == sliding["decode"]["variant"] == variant
        assert "last 16 positions" in sliding["decode"]["reason"] and "last" not in full["decode"]["reason"]
        assert "soft-capped at 20" in full["decode"]["reason"] and "soft-capped" in full["prefill"]
        assert "freed" in sliding["kv_cache"] and "every block" in full["kv_cache"]
        assert "(1 + w)" in entry["kernels"]["RMSNorm"]["unused"] and "gelu_tanh" in entry["kernels"]["SiluAndMul"]["unused"]
        assert "unused" not in entry["kernels"]["PagedAttention"]
    assert "Triton kernel" in h100["attention"][1]["decode"]["reason"]
    assert main(["plan", "--simulate", "sm_90", "--model", str(path)]) == 0
    out = capsys.readouterr().out
    assert "model " + str(path) + ": gemma2 (" in out and "  attention sliding (16): layers [0, 2]" in out
    assert "not used: its RMSNorm scales by (1 + w)" in out


def test_plan_with_a_directory_that_is_no_model_says_why(capsys, tmp_path):
    assert main(["plan", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "`--model " + str(tmp_path) + "`" in err and "config.json" in err
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    assert main(["plan", "--model", str(tmp_path)]) == 2
    assert "GPT2LMHeadModel" in capsys.readouterr().err


def test_plan_with_a_mixture_of_experts_shows_the_expert_kernel_per_device(capsys, tmp_path):
    """gpt-oss: every feed-forward has experts, so the plan marks SiluAndMul unused and FusedMoE
    used, per device its own expert kernel; its decode reason names the sinks."""
    from tests.family_checkpoints import make_family_checkpoint

    path = make_family_checkpoint("gpt_oss", tmp_path / "oss")
    plan = _plan_json(capsys, "--simulate", "cpu,sm_75,sm_90", "--model", str(path))
    assert plan["model"]["features"]["experts"] == "2 of 4" and plan["model"]["features"]["attention_sinks"]
    variants = [e["kernels"]["FusedMoE"]["variant"] for e in plan["devices"]]
    assert variants[0] == "torch" and variants[2].startswith("triton") and len(set(variants)) >= 2
    for entry in plan["devices"]:
        assert "unused" not in entry["kernels"]["FusedMoE"] and "experts" in entry["kernels"]["SiluAndMul"]["unused"]
        assert all("sink" in row["decode"]["reason"] for row in entry["attention"])
