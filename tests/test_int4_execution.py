"""Each device's 4-bit execution: the rule (workers/quant/int4_methods.py) and the kernel mapping agree.

For every capability from sm_50 to sm_121, the ROCm architectures and the CPU, the kernel chosen for
`Int4CheckpointLinear` runs the execution the rule names (the variant's first word), with a reason:
below sm_75 the weights are dequantized at load, from sm_75 (and on ROCm) the Triton W4A16 layer
with the architecture's tuning, on the CPU the packed torch layer. A capability newer than any tuned
one gets a defined choice.
"""

from __future__ import annotations

import pytest

from kernels_local.mapping import select
from workers.quant.int4_methods import INT4_EXECUTIONS, int4_execution

CUDA = [(major, minor) for major in range(5, 13) for minor in range(0, 10) if (major, minor) <= (12, 1)]
ROCM = [(9, 0), (9, 4), (9, 5), (11, 0)]


def _devices():
    yield "cpu", None
    yield from (("cuda", c) for c in CUDA)
    yield from (("rocm", c) for c in ROCM)


@pytest.mark.parametrize(("device_type", "capability"), list(_devices()))
def test_the_kernel_chosen_runs_the_execution_the_rule_names(device_type, capability):
    execution = int4_execution(device_type, capability)
    choice = select(device_type, capability)["Int4CheckpointLinear"]
    assert execution.kind in INT4_EXECUTIONS and execution.reason
    assert choice.variant.split("-")[0] == execution.kind, (choice.variant, execution)
    assert execution.packed == (execution.kind != "dequantized")


@pytest.mark.parametrize(("device_type", "capability", "kind", "layer"), [
    ("cpu", None, "packed", "Int4CheckpointLinear"),
    ("cuda", (6, 1), "dequantized", "Int4CheckpointLinearDequantized"),
    ("cuda", (7, 0), "dequantized", "Int4CheckpointLinearDequantized"),
    ("cuda", (7, 5), "w4a16", "Int4LinearTritonSm75"),
    ("cuda", (8, 6), "w4a16", "Int4LinearTritonSm80"),
    ("cuda", (9, 0), "w4a16", "Int4LinearTritonSm90"),
    ("cuda", (12, 0), "w4a16", "Int4LinearTritonSm90"),
    ("rocm", (9, 4), "w4a16", "Int4LinearTritonRocm"),
])  # fmt: skip
def test_each_device_class_gets_its_execution_and_says_why(device_type, capability, kind, layer):
    execution = int4_execution(device_type, capability)
    choice = select(device_type, capability)["Int4CheckpointLinear"]
    assert (execution.kind, choice.layer) == (kind, layer)
    if kind == "dequantized":
        assert "below sm_75" in execution.reason and "widened" in execution.reason
    elif kind == "packed":
        assert "packed" in execution.reason and "_weight_int4pack_mm" not in execution.reason
    else:
        assert "W4A16" in execution.reason and "packed" in execution.reason


@pytest.mark.parametrize("fmt", ["gptq", "awq", "pack-quantized"])
def test_placement_sizes_packed_bytes_where_the_4_bits_stay_and_widened_below_sm75(tmp_path, fmt):
    """`need_on` follows the rule: on sm_75 and up (and the CPU) the need is what the worker holds with
    its packed layers, below sm_75 what it holds widened, and the two differ by the widening."""
    from tests.family_checkpoints import make_family_checkpoint
    from tests.int4_checkpoints import quantize_checkpoint
    from workers.contract import parse_simulate
    from workers.contract.model_size import need_on, read_profile
    from workers.model.loader import load_model

    src = make_family_checkpoint("llama", tmp_path / "src")
    ckpt, _ = quantize_checkpoint(src, tmp_path / fmt, fmt, 32, fmt != "awq", False, (), False)
    profile = read_profile(ckpt)
    needs, held = {}, {}
    for token, device in (
        ("sm_70", ("cuda", (7, 0))),
        ("sm_75", ("cuda", (7, 5))),
        ("sm_90", ("cuda", (9, 0))),
    ):
        model = load_model(ckpt, "bfloat16", device_type=device[0], capability=device[1]).model
        unique = {t.data_ptr(): t for t in model.state_dict().values()}
        held[token] = sum(t.numel() * t.element_size() for t in unique.values())
        needs[token] = need_on(profile, parse_simulate(token)[0], "bfloat16").weight_bytes
    for token in needs:
        assert 0.9 * held[token] <= needs[token] <= 1.25 * held[token], (token, needs, held)
    assert needs["sm_75"] == needs["sm_90"] < needs["sm_70"] and held["sm_90"] < held["sm_70"]
    assert needs["sm_70"] - needs["sm_90"] == profile.packed4_params * 2 - profile.packed4_params // 2
    shown = {t: need_on(profile, parse_simulate(t)[0], "bfloat16").describe() for t in ("sm_70", "sm_90")}
    assert "4-bit layers widened at load" in shown["sm_70"] and "4-bit layers packed" in shown["sm_90"], shown


def test_deterministic_mode_tiles_the_4bit_layers_rows(tmp_path):
    """`--deterministic` cuts every projection's rows into fixed tiles, the 4-bit layers' included: a row's
    logits through the packed layers do not depend on its batch mates, bit for bit."""
    import torch

    from tests.family_checkpoints import make_family_checkpoint
    from tests.int4_checkpoints import quantize_checkpoint
    from workers.device.bind import BoundDevice
    from workers.kernelize.apply import kernelize_for_device
    from workers.model.deterministic import enable_deterministic
    from workers.model.loader import load_model
    from workers.quant.int4_linear import Int4CheckpointLinear

    src = make_family_checkpoint("llama", tmp_path / "src")
    ckpt, _ = quantize_checkpoint(src, tmp_path / "awq", "awq", 32)
    model = load_model(ckpt, "bfloat16").model  # no device bound: the CPU's packed execution
    kernelize_for_device(model, BoundDevice("cpu", 0, "cpu", "cpu", None, 0, False))
    layers = [m for m in model.modules() if isinstance(m, Int4CheckpointLinear)]
    assert layers and all(m.execution == "packed" for m in layers)
    plan = enable_deterministic(model)
    assert plan.projections >= len(layers)
    assert all(m.forward.__func__.__name__ == "forward" and "tiled_rows" in m.forward.__func__.__code__.co_names
               for m in layers)  # fmt: skip
    ids = torch.tensor([[1, 17, 400, 1023, 9, 5, 77]])
    mates = torch.cat([ids, torch.randint(3, 4000, (5, 7), generator=torch.Generator().manual_seed(1))])
    with torch.no_grad():
        assert torch.equal(model(ids)[0], model(mates)[0])


def test_plan_model_names_each_devices_4bit_kernel_and_sizes_what_it_holds(tmp_path, capsys):
    """`hetserve plan --model DIR` on a mixed host: each device's `Int4CheckpointLinear` kernel says its
    execution and why, and the placement sizes the packed bytes from sm_75 and the widened ones on sm_70."""
    import json

    from server.cli import main
    from tests.family_checkpoints import make_family_checkpoint
    from tests.int4_checkpoints import quantize_checkpoint

    src = make_family_checkpoint("llama", tmp_path / "src")
    ckpt, _ = quantize_checkpoint(src, tmp_path / "awq", "awq", 32)
    assert main(["plan", "--model", str(ckpt), "--simulate", "sm_70,sm_75,sm_86,sm_90", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert "awq" in plan["model"]["features"]["quantization"]
    kinds = [d["kernels"]["Int4CheckpointLinear"]["variant"].split("-")[0] for d in plan["devices"]]
    assert kinds == ["dequantized", "w4a16", "w4a16", "w4a16"]
    assert plan["devices"][0]["kernels"]["Int4CheckpointLinear"]["reason"].startswith("sm_70: below sm_75")
    slots = {s["worker_id"]: s for s in plan["placement"]["devices"]}
    assert "4-bit layers widened at load" in slots["gpu0"]["reason"]
    assert all("4-bit layers packed" in slots[w]["reason"] for w in ("gpu1", "gpu2", "gpu3"))
