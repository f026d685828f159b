"""`hetserve plan`: every device gets a kernel for every layer and the fp8 convention with
reasons, in `/workers`' field names, from the same decision code the workers run; the text reads
top-down, the placement first, then per device only the kernels its model runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import server.commands.inventory
from kernels_local.mapping import LAYERS
from server.cli import main
from server.commands.plan import _render, build_plan
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
    # and the 4-bit checkpoints' layer keeps its packed weights (torch); the norm and the activation in C++,
    # a GGUF file's blocks through the C++ GEMV
    assert {k["variant"] for k in entry["kernels"].values()} == {"torch", "emulated-torch", "dequantized-torch",
                                                                 "packed-torch", "cpp", "cpp-gemv"}


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
        assert ("(1 + w)" in entry["kernels"]["RMSNorm"]["unused"]
                and "gelu_tanh" in entry["kernels"]["SiluAndMul"]["unused"])
        assert "unused" not in entry["kernels"]["PagedAttention"]
    assert "Triton kernel" in h100["attention"][1]["decode"]["reason"]
    assert main(["plan", "--simulate", "sm_90", "--model", str(path), "--all-kernels"]) == 0  # unused ones too
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


# --- the text reads top-down: the placement, then per device only the kernels its model runs ---
PLACEMENT_LINE = re.compile(r"^  (gpu|cpu)\d+ \(")


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory) -> dict:
    """`plan --model` of a tiny dense Llama on three devices, the first too small to hold it."""
    from tests.checkpoints import make_checkpoint

    return build_plan("sm_75:256KiB,sm_80,sm_90", model=str(make_checkpoint(tmp_path_factory.mktemp("p") / "m")))


def _placement_lines(text: str) -> list[str]:
    head = text.split("\n\n")[0].splitlines()
    assert head[0].startswith("placement: ")
    return [line for line in head if PLACEMENT_LINE.match(line)]


def test_the_placement_comes_before_any_device_section(tiny_plan, capsys):
    for text in (_render(tiny_plan), _render(tiny_plan, all_kernels=True)):
        assert text.startswith("placement: m on gpu1, gpu2\n")
        first_section = text.index("\ndevice 0: ")
        assert text.index("  gpu2 (9.0, 80 GiB): m [") < text.index("\nmodel ") < first_section
        assert "\n  fp8 " not in text[:first_section] and "\n  RMSNorm " not in text[:first_section]
    assert main(["plan", "--simulate", "sm_80,sm_90"]) == 0  # without --model: no model, every kernel listed
    out = capsys.readouterr().out
    assert out.startswith("placement: none without --model") and out.index("\ndevice 0: ") > out.index("  gpu1 (")


def test_one_placement_line_per_device(tiny_plan, capsys, tmp_path):
    lines = _placement_lines(_render(tiny_plan))
    assert [line.split()[0] for line in lines] == ["gpu0", "gpu1", "gpu2"]
    assert lines[0] == "  gpu0 (7.5, 256 KiB): free [free] no model fits (the smallest needs 337 KiB)"
    assert "m [first]" in lines[1] and "m [replica]" in lines[2]
    assert main(["plan", "--simulate", "sm_75,cpu,sm_90"]) == 0  # no model: each device says so
    assert _placement_lines(capsys.readouterr().out) == ["  gpu0 (7.5, 16 GiB): no model",
                                                         "  cpu1 (cpu, 16 GiB): no model",
                                                         "  gpu2 (9.0, 80 GiB): no model"]
    from tests.checkpoints import make_checkpoint

    big = make_checkpoint(tmp_path / "big", vocab_size=4096, hidden_size=256, intermediate_size=1024)
    piped = build_plan("sm_86:6MiB,sm_80:6MiB,sm_75:4MiB", model=str(big))  # a pipeline over two, one free
    lines = _placement_lines(_render(piped))
    assert len(lines) == 3 and "pipeline stage 0" in lines[0] and "pipeline stage 1" in lines[1]
    assert "free [free]" in lines[2] and "\n  stage 1 gpu1 (8.0): layers 1:2" in _render(piped)
    failed = build_plan("sm_90:128KiB,sm_80:128KiB", model=str(big))  # fits nowhere: each device placed nothing
    assert _placement_lines(_render(failed)) == ["  gpu0 (9.0, 128 KiB): nothing placed",
                                                 "  gpu1 (8.0, 128 KiB): nothing placed"]


def test_an_unused_kernel_is_left_out_without_the_flag_and_listed_with_it(tiny_plan):
    text, full = _render(tiny_plan), _render(tiny_plan, all_kernels=True)
    for layer in ("RMSNorm", "SiluAndMul", "PagedAttention"):  # what a dense Llama runs, on the two serving devices
        assert text.count(f"\n  {layer} ") == 2 and full.count(f"\n  {layer} ") == 3
    for layer in ("FusedMoE", "GatedDeltaRule", "Fp8Linear", "Fp8CheckpointLinear", "Int4CheckpointLinear",
                  "GGUFLinear", "GGUFExperts"):
        assert f"\n  {layer} " not in text and full.count(f"\n  {layer} ") == 3
    assert "not used: a dense model: no experts" in full and "not used:" not in text
    assert "not used: no `--quantize fp8`" in full
    assert ("  not listed (its model does not run them; --all-kernels lists them): Fp8Linear, FusedMoE, "
            "Fp8CheckpointLinear, GatedDeltaRule, Fp8FusedMoE, Int4CheckpointLinear, Mxfp4FusedMoE, LoraDelta, "
            "GGUFLinear, GGUFExperts") in text
    assert "not listed" not in full
    for entry in tiny_plan["devices"]:  # the JSON keeps every kernel; the ones not run say why
        assert list(entry["kernels"]) == list(LAYERS)
        assert {n for n, k in entry["kernels"].items() if "unused" not in k} == {"RMSNorm", "SiluAndMul",
                                                                                "PagedAttention"}


def test_a_device_that_serves_nothing_says_so_and_lists_no_kernel(tiny_plan):
    text = _render(tiny_plan)
    section = text[text.index("\ndevice 0: "):text.index("\ndevice 1: ")]
    assert section.splitlines()[1].endswith(" serves no model") and "\n  fp8 " in section
    assert "  not listed (it serves no model; --all-kernels lists them): RMSNorm, SiluAndMul" in section
    assert "attention full" not in section and "\n  RMSNorm " not in section
    assert "\n  RMSNorm " in _render(tiny_plan, all_kernels=True).split("\ndevice 1: ")[0]


def test_the_flag_is_in_the_help_and_the_json_ignores_it(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "--all-kernels" in capsys.readouterr().out
    assert _plan_json(capsys, "--simulate", "sm_90", "--all-kernels") == _plan_json(capsys, "--simulate", "sm_90")


def test_compile_records_follow_the_kernels_listed_and_a_refused_hidden_one_is_named():
    from server.commands.plan import render_device

    entry = {"device": simulated_device("sm_90", 0).to_dict(), "fp8": {"convention": "native_e4m3", "reason": "r"},
             "kernels": {"RMSNorm": {"repo": "kernels_local/rmsnorm", "layer": "L", "variant": "v", "reason": "why",
                                     "compiled": {"ok": True, "configs": [_record("_rms_norm_kernel", True)]}},
                         "FusedMoE": {"repo": "kernels_local/fused_moe", "layer": "F", "variant": "v", "reason": "r",
                                      "unused": "a dense model: no experts",
                                      "compiled": {"ok": False, "configs": [_record("_moe_kernel", False)]}}}}
    text = "\n".join(render_device(entry))
    assert "_rms_norm_kernel on sm_90a: 1/1 configurations ok" in text and "_moe_kernel" not in text
    assert text.endswith("--all-kernels lists them): FusedMoE; REFUSED by preflight: FusedMoE")
    full = "\n".join(render_device(entry, all_kernels=True))
    assert "_moe_kernel on sm_90a: 0/1 configurations ok" in full and "REFUSED BLOCK=1: too big" in full


def _record(kernel: str, ok: bool) -> dict:
    return {"kernel": kernel, "target": "sm_90a", "config": "BLOCK=1", "ok": ok, "shared_bytes": 32, "registers": 8,
            "spill_bytes": 0, "instruction": None, "instruction_ok": None, "error": None if ok else "too big"}


@pytest.mark.parametrize(
    ("quantization", "device", "quantize", "runs", "left"),
    [
        (None, ("cuda", "9.0"), "fp8", {"Fp8Linear"}, {"Fp8CheckpointLinear", "Int4CheckpointLinear"}),
        ({"method": "fp8", "format": "block-wise"}, ("cuda", "8.0"), "none", {"Fp8CheckpointLinear"},
         {"Fp8Linear", "Fp8FusedMoE", "Int4CheckpointLinear", "Mxfp4FusedMoE"}),
        ({"method": "awq", "bits": 4}, ("cpu", None), "none", {"Int4CheckpointLinear"},
         {"Fp8CheckpointLinear", "Mxfp4FusedMoE"}),
        ({"method": "mxfp4", "bits": 4, "ignore": []}, ("cuda", "9.0"), "none", {"Mxfp4FusedMoE"}, {"FusedMoE"}),
        ({"method": "mxfp4", "bits": 4, "ignore": []}, ("cuda", "7.5"), "none", {"FusedMoE"}, {"Mxfp4FusedMoE"}),
        ({"method": "mxfp4", "bits": 4, "ignore": ["model.layers.0.mlp.experts"]}, ("rocm", "9.4"), "none",
         {"FusedMoE", "Mxfp4FusedMoE"}, {"Int4CheckpointLinear"}),
    ],
)
def test_which_kernels_a_checkpoint_runs_per_device(quantization, device, quantize, runs, left):
    """Guards workers/contract/kernel_layers.py `unused_layers`: pure, from the workers' description."""
    from workers.contract.kernel_layers import unused_layers

    dense = {"FusedMoE": "a dense model: no experts", "GatedDeltaRule": "no linear-attention layers"}
    moe = {"SiluAndMul": "every feed-forward is a mixture of experts (FusedMoE)"}
    lacks = moe if quantization and quantization["method"] == "mxfp4" else dense
    described = {"kernel_layers_unused": lacks, **({"quantization": quantization} if quantization else {})}
    unused = unused_layers(described, *device, quantize)
    assert not runs & set(unused) and left <= set(unused), unused
    assert all(unused.values()) and set(lacks) <= set(unused)
    if quantization and quantization["method"] == "fp8":  # a dense fp8 checkpoint: no experts to hold in fp8
        assert unused["Fp8FusedMoE"] == "a dense model: no experts"


@pytest.mark.parametrize(("moe", "device", "runs"), [
    (True, ("cuda", "8.6"), {"GGUFLinear", "GGUFExperts"}), (False, ("cuda", "8.6"), {"GGUFLinear"}),
    (True, ("cpu", None), {"GGUFLinear", "GGUFExperts"}), (True, ("cuda", "6.1"), set())])  # fmt: skip
def test_a_gguf_files_experts_layer_is_listed_only_where_its_experts_stay_packed(moe, device, runs):
    """Guards the `GGUFExperts` line of workers/contract/kernel_layers.py `unused_layers`: a MoE GGUF file on a
    device that keeps GGUF blocks packed runs the experts' layer; a dense file, or a device that dequantizes
    at load (sm_61), does not."""
    from workers.contract.kernel_layers import unused_layers

    lacks = {"SiluAndMul": "every feed-forward is a mixture of experts"} if moe else {"FusedMoE": "a dense model"}
    unused = unused_layers({"kernel_layers_unused": lacks, "gguf": {"types": {"Q4_K": 3}}}, *device)
    assert not runs & set(unused) and {"GGUFLinear", "GGUFExperts"} - runs <= set(unused), unused
