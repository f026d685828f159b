"""The CPU experts' C++ loop over their oneDNN packs (kernels_local/fused_moe/cpu_experts.cpp):
bit for bit the Python loop it replaces (`fused_moe_packed` with the loop off; in float32 through
oneDNN's batch-reduce GEMM on copies of the packs laid out for it, made on first use), in
float32 and bfloat16, for every activation, with and without biases, at row counts that the loop pads and
with experts that receive no pair; its errors; and the switch that keeps the Python loop.

The C++ source is built on first use (20-30 s once per host, then cached by torch); without a
C++ compiler the tests that need it skip with the reason the loader gives.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from kernels_local.fused_moe import cpu_experts
from kernels_local.fused_moe.cpu_experts import CpuExperts
from tests.test_kernels_moe import _with_packs, make_case
from workers.model.cpu_projections import packing_refusal

torch_path = importlib.import_module("kernels_local.fused_moe.torch_path")


def _needs_loop():
    state = cpu_experts.load()
    if not state.available:
        pytest.skip(state.reason)


def _python_loop(monkeypatch, case):
    """`fused_moe_packed` with the C++ loop off: the Python loop's output."""
    with monkeypatch.context() as m:
        m.setattr(torch_path.cpu_experts, "load", lambda: CpuExperts(False, "the Python loop"))
        return torch_path.fused_moe_packed(**case)


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai", "gelu_tanh"])
@pytest.mark.parametrize("t, k, e", [(1, 1, 4), (9, 2, 8), (37, 2, 4), (33, 4, 8)])
def test_the_cpp_loop_is_the_python_loop_bit_for_bit(monkeypatch, dtype, activation, t, k, e):
    """Same oneDNN products, same activation ops, the weighted sum rounded as torch's mul and
    `index_add_` round: equal, not close. (37, 2, 4) gives experts of more than eight rows that are
    no multiple of eight (padded rows), every case leaves experts without pairs."""
    _needs_loop()
    if packing_refusal(dtype) is not None:
        pytest.skip(f"this CPU's oneDNN cannot pack {dtype}: {packing_refusal(dtype)}")
    for bias in (False, True):
        case = make_case(t, k, e, bias=bias, activation=activation, dtype=dtype, seed=t + e, gain=3.0)
        ours = torch_path.fused_moe_packed(**_with_packs(case))
        assert ours.dtype == dtype and ours.shape == case["x"].shape
        assert torch.equal(ours, _python_loop(monkeypatch, _with_packs(case))), (dtype, activation, t, k, e, bias)


def _with_panels(case):
    """`case` with copies of its expert stacks laid out as column panels, as a CPU worker lays them
    out where its panel GEMM builds (kernels_local/panel_linear/cpu.py)."""
    from kernels_local.panel_linear import cpu as cpu_gemm
    from workers.model.cpu_projections import PACKED_ATTR

    case = dict(case)
    for name in ("w_gate_up", "w_down"):
        w = case[name].clone()
        setattr(w, PACKED_ATTR, tuple(cpu_gemm.panels(w[e]) for e in range(w.shape[0])))
        case[name] = w
    return case


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("t, k, e", [(1, 1, 4), (37, 2, 4), (33, 4, 8)])
def test_over_panels_the_cpp_loop_is_the_python_loop_over_packs_bit_for_bit(monkeypatch, dtype, activation, t, k, e):
    """The worker's panels (brgemm, cpu_experts.cpp `product`) give the packs' products on these
    reductions (72 and 40), the bias added to float32 sums and rounded once as oneDNN does; the
    grouped path's dispatch takes the C++ loop over them (the Python loop reads packs only)."""
    _needs_loop()
    if packing_refusal(dtype) is not None:
        pytest.skip(f"this CPU's oneDNN cannot pack {dtype}: {packing_refusal(dtype)}")
    for bias in (False, True):
        case = make_case(t, k, e, bias=bias, activation=activation, dtype=dtype, seed=t + e + 1, gain=3.0)
        ours = torch_path.fused_moe_grouped(**_with_panels(case))
        assert torch.equal(ours, _python_loop(monkeypatch, _with_packs(case))), (dtype, activation, t, k, e, bias)


def test_the_cpp_loop_reads_each_experts_pack_and_weighs_each_pair(monkeypatch):
    """The loop multiplies through the packs it is given (others change the result) and applies
    each pair's router weight (doubling one token's weights doubles only its row)."""
    from workers.model.cpu_projections import PACKED_ATTR, pack

    _needs_loop()
    case = _with_packs(make_case(17, 2, 4, seed=2))
    right = torch_path.fused_moe_packed(**case)
    doubled = dict(case, topk_weights=case["topk_weights"].clone())
    doubled["topk_weights"][3] *= 2
    out = torch_path.fused_moe_packed(**doubled)
    torch.testing.assert_close(out[3], 2 * right[3])
    assert torch.equal(out[:3], right[:3]) and torch.equal(out[4:], right[4:])
    other = torch.randn_like(case["w_down"])
    setattr(case["w_down"], PACKED_ATTR, tuple(pack(other[i]) for i in range(other.shape[0])))
    assert not torch.equal(torch_path.fused_moe_packed(**case), right)


def test_an_expert_id_out_of_range_is_an_error_naming_it():
    _needs_loop()
    case = _with_packs(make_case(5, 2, 4, seed=1))
    case["topk_ids"] = case["topk_ids"].clone()
    case["topk_ids"][2, 1] = 9
    with pytest.raises(RuntimeError, match=r"expert id `9` outside \[0, 4\)"):
        torch_path.fused_moe_packed(**case)


def test_the_switch_keeps_the_python_loop_and_says_so(monkeypatch):
    """Guards `load()`'s `$HETSERVE_CPU_EXPERTS=off` branch: nothing is built, the reason names it."""
    monkeypatch.setenv(cpu_experts.ENV_CPU_EXPERTS, "off")
    cpu_experts.load.cache_clear()
    try:
        state = cpu_experts.load()
        assert not state.available and "HETSERVE_CPU_EXPERTS=off" in state.reason
    finally:
        monkeypatch.delenv(cpu_experts.ENV_CPU_EXPERTS)
        cpu_experts.load.cache_clear()
    assert cpu_experts.load().available or "unavailable" in cpu_experts.load().reason


@pytest.mark.parametrize("rows, from_cpp, wins", [(1.9, False, False), (2.0, False, True), (0.25, True, True)])
def test_packed_wins_from_cpp_always_and_from_python_from_two_rows(rows, from_cpp, wins):
    assert torch_path.packed_wins(rows, from_cpp) is wins
