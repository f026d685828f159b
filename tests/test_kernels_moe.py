"""The fused MoE kernel (`kernels_local/fused_moe`) against its torch reference and the model's
`grouped_experts`, on CPU under `TRITON_INTERPRET=1`; its layers as the model module's
forward; its alignment; its compile specs against the launches the wrapper makes; and, on a
real GPU, the compiled kernel on Qwen3-30B-A3B and gpt-oss-20b shapes.

As in tests/test_kernels_triton.py, triton must be imported with the variable already set,
so `test_kernels_run_under_the_interpreter` re-runs this file in a child with
`TRITON_INTERPRET=1` and the interpreter tests skip in the parent. Shapes stay small (about
1 ms per program instance) with widths that are not multiples of the tiles (72 and 40), and
the `TINY` tuning (16 x 16 x 16 tiles, grouped by 2) puts several blocks in every dimension
and more than one block into an expert. fp32 is compared tightly; fp16/bf16 to a fraction of
the output's scale (the kernel rounds where the reference does, but sums in another order).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from kernels_local import expert_pairs
from tests.interpreter import INTERPRETED, needs_interpreter, rerun_under_interpreter
from tests.test_compile_specs import _jit_type, _launched, _Recorder
from workers.model.moe import FusedMoE as ModelFusedMoE
from workers.model.moe import grouped_experts

moe = importlib.import_module("kernels_local.fused_moe.fused_moe")  # the package exports a function of that name
torch_path = importlib.import_module("kernels_local.fused_moe.torch_path")
TINY = moe.FusedMoETuning("tiny", moe.MoEConfig(16, 16, 16, 2, 1, 1), moe.MoEConfig(16, 16, 16, 2, 1, 1))
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CASES = [(1, 1, 4), (3, 2, 8), (17, 4, 8), (17, 2, 4)]  # (tokens, top-k, experts)
HIDDEN, INTER = 72, 40  # hidden and intermediate widths: tails in every tile dimension


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
def test_kernels_run_under_the_interpreter():
    """The interpreter's run of this file: collected from the background child started with the
    suite (tests/interpreter.py), run here only when this file runs alone."""
    rerun_under_interpreter(__file__)


def make_case(t, k, e, h=HIDDEN, i=INTER, *, bias=False, activation="silu", dtype=torch.float32, seed=0, gain=1.0,
              device="cpu"):  # fmt: skip
    """Inputs of one MoE call; the last `min(2, e - k)` experts receive no token. `gain` scales
    the gate_up weights (3 puts many pre-activations past swiglu_oai's clamp at 7)."""
    g = torch.Generator().manual_seed(seed)
    skip = min(2, e - k)
    args = dict(
        x=torch.randn(t, h, generator=g),
        w_gate_up=torch.randn(e, 2 * i, h, generator=g) * (gain / h**0.5),
        w_down=torch.randn(e, h, i, generator=g) / i**0.5,
        b_gate_up=torch.randn(e, 2 * i, generator=g) if bias else None,
        b_down=torch.randn(e, h, generator=g) if bias else None,
    )
    args = {n: None if v is None else v.to(device=device, dtype=dtype) for n, v in args.items()}
    ids = torch.rand(t, e - skip, generator=g).topk(k, dim=-1).indices  # [T, K] int64, distinct per token
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=-1)  # fp32, as routers give them
    return dict(args, topk_ids=ids.to(device), topk_weights=weights.to(device), activation=activation)


def assert_moe_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        scale = ref.abs().max().item()
        tol = 1e-2 if ref.dtype == torch.float16 else 3e-2
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale)


# -- without the interpreter: alignment, argument checks, the CPU path ------------------------


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_alignment_gives_each_block_one_expert_and_every_pair_once(block_m):
    ids = torch.tensor([[3, 0], [3, 5], [0, 3], [5, 3], [3, 0]])  # experts 1, 2, 4, 6, 7 get nothing
    e, p = 8, ids.numel()
    pairs, experts, num_padded = expert_pairs.align_pairs(ids, e, block_m)  # shared by every grouped GEMM
    counts = torch.bincount(ids.flatten(), minlength=e)
    assert num_padded.tolist() == [int(((counts + block_m - 1) // block_m * block_m).sum())]
    assert pairs.numel() == expert_pairs.max_padded_pairs(p, e, block_m) >= num_padded.item()
    assert pairs.numel() % block_m == 0 and experts.numel() == pairs.numel() // block_m
    used = pairs[: num_padded.item()].view(-1, block_m)
    for block, expert in zip(used, experts, strict=False):
        real = block[block < p].long()
        assert real.numel() > 0, "a block inside the padded runs holds at least one pair"
        assert (ids.flatten()[real] == expert).all()
        assert torch.equal(real, real.sort().values), "tokens ascend within an expert"
    assert sorted(pairs[pairs < p].tolist()) == list(range(p))
    assert (pairs[num_padded.item():] == p).all()


def test_arguments_are_checked_naming_the_bad_value():
    case = make_case(2, 2, 4)
    with pytest.raises(ValueError, match="Unknown expert activation `gelu`. Supported: silu, swiglu_oai"):
        moe.fused_moe(**{**case, "activation": "gelu"})
    with pytest.raises(TypeError, match="got `torch.bfloat16`, `torch.float32`"):
        moe.fused_moe(**{**case, "x": case["x"].bfloat16()})
    with pytest.raises(ValueError, match=r"w_down \[E, 72, I\]; got `\(4, 80, 72\)` and `\(4, 72, 39\)`"):
        moe.fused_moe(**{**case, "w_down": case["w_down"][..., :39]})
    with pytest.raises(ValueError, match=r"both be \[2, K\]; got `\(2, 2\)` and `\(2, 1\)`"):
        moe.fused_moe(**{**case, "topk_weights": case["topk_weights"][:, :1]})


@pytest.mark.parametrize("row_tile", [None, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_torch_reference_is_the_models_grouped_experts_bit_for_bit(dtype, row_tile):
    case = make_case(17, 4, 8, bias=True, activation="swiglu_oai", dtype=dtype, gain=3.0)
    ref = torch_path.fused_moe_reference(**case, row_tile=row_tile)
    assert torch.equal(ref, grouped_experts(**case, row_tile=row_tile))
    if not INTERPRETED:  # CPU tensors without the interpreter: every tuning runs the grouped torch path
        for tuning in moe.TUNINGS.values():
            assert torch.equal(moe.fused_moe(**case, tuning=tuning), torch_path.fused_moe_grouped(**case))


# -- the CPU path: one grouped GEMM per projection ----------------------------------------------


@pytest.mark.parametrize("activation", ["silu", "swiglu_oai", "gelu_tanh"])
@pytest.mark.parametrize("t,k,e", CASES, ids=lambda v: str(v))
def test_the_grouped_cpu_path_is_the_reference_in_fp32(t, k, e, activation):
    """The same per-expert products (experts without tokens included), within fp32 rounding:
    the activation runs over all pairs at once and its vector tail may round an ulp apart,
    and a bias is added after the product rather than inside it."""
    for bias in (False, True):
        case = make_case(t, k, e, bias=bias, activation=activation, seed=t + k + e, gain=3.0)
        assert_moe_close(torch_path.fused_moe_grouped(**case), torch_path.fused_moe_reference(**case))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_grouped_cpu_path_is_close_to_the_reference_in_every_dtype(dtype):
    case = make_case(17, 4, 8, bias=True, activation="swiglu_oai", dtype=dtype, gain=3.0)
    assert_moe_close(torch_path.fused_moe_grouped(**case), torch_path.fused_moe_reference(**case))
    empty = make_case(0, 2, 4, dtype=dtype)
    assert torch_path.fused_moe_grouped(**empty).shape == (0, HIDDEN)


def _with_packs(case: dict) -> dict:
    """`case` with copies of its expert stacks carrying oneDNN packs, as a CPU worker makes them
    (workers/model/cpu_projections.py)."""
    from workers.model.cpu_projections import PACKED_ATTR, pack

    case = dict(case)
    for name in ("w_gate_up", "w_down"):
        w = case[name].clone()
        setattr(w, PACKED_ATTR, tuple(pack(w[e]) for e in range(w.shape[0])))
        case[name] = w
    return case


@pytest.mark.parametrize("t, k, e", [(17, 2, 4), (16, 4, 8), (9, 2, 8)])
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai", "gelu_tanh"])
def test_the_packed_cpu_path_is_the_reference_in_fp32(t, k, e, activation):
    """The experts' oneDNN packs give the reference's per-expert products within fp32 rounding
    (experts without tokens included, biases inside the product), at two rows per expert or more."""
    for bias in (False, True):
        case = _with_packs(make_case(t, k, e, bias=bias, activation=activation, seed=t + k + e, gain=3.0))
        assert_moe_close(torch_path.fused_moe_packed(**case), torch_path.fused_moe_reference(**case))


@pytest.mark.parametrize("from_cpp", [False, True])
def test_the_packed_path_runs_where_it_wins_and_reads_the_packs(monkeypatch, from_cpp):
    """Guards `fused_moe_grouped`'s dispatch (`packed_wins`): from Python, from two rows per expert;
    from C++, always; where it runs, packs of other weights change the result, below it the
    grouped GEMM ignores them."""
    from kernels_local.fused_moe.cpu_experts import CpuExperts
    from workers.model.cpu_projections import PACKED_ATTR, pack

    if from_cpp and not torch_path.cpu_experts.load().available:
        pytest.skip(torch_path.cpu_experts.load().reason)
    if not from_cpp:
        monkeypatch.setattr(torch_path.cpu_experts, "load", lambda: CpuExperts(False, "the Python loop"))
    cases = ((16, True), (3, True)) if from_cpp else ((16, True), (3, False))  # 8 experts, top-2
    for t, used in cases:
        case = _with_packs(make_case(t, 2, 8, bias=True, seed=5))
        right = torch_path.fused_moe_grouped(**case)
        other = torch.randn_like(case["w_gate_up"])
        setattr(case["w_gate_up"], PACKED_ATTR, tuple(pack(other[e]) for e in range(other.shape[0])))
        changed = not torch.equal(torch_path.fused_moe_grouped(**case), right)
        assert changed == used, (t, used)


def test_the_packed_path_is_close_to_the_reference_in_bfloat16():
    from workers.model.cpu_projections import packing_refusal

    if packing_refusal(torch.bfloat16) is not None:
        pytest.skip(f"this CPU's oneDNN cannot pack bfloat16: {packing_refusal(torch.bfloat16)}")
    case = _with_packs(make_case(17, 4, 8, bias=True, activation="swiglu_oai", dtype=torch.bfloat16, gain=3.0))
    assert_moe_close(torch_path.fused_moe_grouped(**case), torch_path.fused_moe_reference(**case))


def test_a_compiled_graph_calls_the_grouped_path_as_one_op():
    """Guards `fused_moe_torch`'s `is_compiling()` branch: without the op, Dynamo traces
    `torch._grouped_mm`, whose fp32 meta kernel refuses (full graph: the compile fails)."""
    case = make_case(9, 2, 8, bias=True, activation="swiglu_oai", seed=3)
    names = ("x", "w_gate_up", "w_down", "topk_ids", "topk_weights", "b_gate_up", "b_down")

    def experts(*tensors):
        return torch_path.fused_moe_torch(*tensors, activation="swiglu_oai") * 2

    compiled = torch.compile(experts, fullgraph=True, backend="aot_eager")
    out = compiled(*(case[n] for n in names))
    assert torch.equal(out, torch_path.fused_moe_grouped(**case) * 2)


# -- the kernel under the interpreter ---------------------------------------------------------


# each case with two of the four (bias, activation) pairs, every pair with two cases: the bias and the
# activation are separate branches of the kernel, so the whole cross product would run each twice over
_PAIRS = [(False, "silu"), (True, "swiglu_oai"), (True, "silu"), (False, "swiglu_oai")]
_CASE_PAIRS = [(*case, *_PAIRS[(2 * i + j) % 4]) for i, case in enumerate(CASES) for j in range(2)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,k,e,bias,activation", _CASE_PAIRS, ids=lambda v: str(v))
@needs_interpreter
def test_kernel_matches_the_reference_and_grouped_experts(t, k, e, bias, activation, dtype):
    case = make_case(t, k, e, bias=bias, activation=activation, dtype=dtype, seed=t * k + e, gain=3.0)
    assert moe.runs_triton(case["x"])
    ref = torch_path.fused_moe_reference(**case)
    assert torch.equal(ref, grouped_experts(**case))
    assert_moe_close(moe.fused_moe(**case, tuning=TINY), ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [3, 33])  # decode and prefill shapes of every tuning
@needs_interpreter
def test_every_tuning_matches_the_reference(tokens, dtype):
    case = make_case(tokens, 4, 8, bias=True, activation="swiglu_oai", dtype=dtype, seed=tokens, gain=3.0)
    ref = torch_path.fused_moe_reference(**case)
    for tuning in moe.TUNINGS.values():
        assert_moe_close(moe.fused_moe(**case, tuning=tuning), ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@needs_interpreter
def test_gelu_tanh_experts_match_the_reference(dtype):
    """Gemma 4's experts, GELU-tanh of the gate times up (guards `_gelu_tanh` and its branch in
    `_activate`): every tuning and the tiny one against the reference, which is the model's
    `grouped_experts`; the activation is not SiLU's."""
    case = make_case(17, 2, 4, activation="gelu_tanh", dtype=dtype, seed=5, gain=3.0)
    ref = torch_path.fused_moe_reference(**case)
    assert torch.equal(ref, grouped_experts(**case))
    assert (ref.float() - torch_path.fused_moe_reference(**{**case, "activation": "silu"}).float()).abs().max() > 0.05
    for tuning in (TINY, *moe.TUNINGS.values()):
        assert_moe_close(moe.fused_moe(**case, tuning=tuning), ref)


@needs_interpreter
def test_swiglu_oai_clamps_past_the_limit():
    """Pre-activations well past +-7 on both halves: a kernel without the clamps (or with
    silu) would be far off; the reference and the kernel agree with a custom alpha and limit."""
    case = make_case(17, 2, 4, bias=True, activation="swiglu_oai", gain=6.0, seed=3)
    h = torch.einsum("th,eoh->teo", case["x"], case["w_gate_up"]) + case["b_gate_up"]  # [T, E, 2I]
    gate, up = h.chunk(2, dim=-1)
    assert (gate > 7).float().mean() > 0.05 and (up > 7).float().mean() > 0.05 and (up < -7).float().mean() > 0.05
    for alpha, limit in ((1.702, 7.0), (1.0, 3.5)):
        ref = torch_path.fused_moe_reference(**case, alpha=alpha, limit=limit)
        assert_moe_close(moe.fused_moe(**case, alpha=alpha, limit=limit, tuning=TINY), ref)
    unclamped = torch_path.fused_moe_reference(**case, limit=1e9)
    assert (unclamped - torch_path.fused_moe_reference(**case)).abs().max() > 1.0


@needs_interpreter
def test_a_token_routed_only_to_empty_experts_of_others_is_untouched():
    """Rows whose router weights are zero come out zero (no bias leaks from padding slots), and
    rows are independent: each token alone gives its own row of the batched call."""
    case = make_case(5, 2, 4, bias=True, dtype=torch.float32, seed=9)
    case["topk_weights"][2] = 0.0
    out = moe.fused_moe(**case, tuning=TINY)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    for row in (0, 4):
        alone = {**case, "x": case["x"][row : row + 1], "topk_ids": case["topk_ids"][row : row + 1],
                 "topk_weights": case["topk_weights"][row : row + 1]}  # fmt: skip
        torch.testing.assert_close(moe.fused_moe(**alone, tuning=TINY)[0], out[row], rtol=1e-6, atol=1e-6)


def _model_layer(bias: bool, activation: str, dtype=torch.float32, seed=0) -> ModelFusedMoE:
    layer = ModelFusedMoE(8, HIDDEN, INTER, bias=bias, activation=activation)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 * 2)
    return layer.to(dtype)


@pytest.mark.parametrize("bias,activation", [(False, "silu"), (True, "swiglu_oai")])
@needs_interpreter
def test_layers_run_as_the_model_modules_forward(bias, activation):
    """Each repository layer installed the way the worker installs it (`apply_plan`, which
    kernelizes through `kernels`): the module then runs that layer's forward, the Triton ones
    through the kernel (the interpreter runs it on CPU tensors), the CPU one through the grouped
    torch path, each close to the model's own."""
    from kernels_local.mapping import select
    from workers.kernelize.apply import KernelPlan, apply_plan

    case = make_case(9, 4, 8, bias=bias, activation=activation, seed=4)
    layer = _model_layer(bias, activation)
    ref = layer(case["x"], case["topk_ids"], case["topk_weights"])
    assert torch.equal(ref, grouped_experts(case["x"], layer.w_gate_up, layer.w_down, case["topk_ids"],
                                            case["topk_weights"], layer.b_gate_up, layer.b_down, activation))
    for device_type, cap in (("cpu", None), ("cuda", (8, 0)), ("cuda", (9, 0)), ("rocm", (9, 4))):
        choice = select(device_type, cap)["FusedMoE"]
        installed = _model_layer(bias, activation)
        assert apply_plan(installed, KernelPlan("cpu", {"FusedMoE": choice})) == 1
        assert installed.forward.__func__ is choice.repository().load().forward
        out = installed(case["x"], case["topk_ids"], case["topk_weights"])
        if choice.variant == "torch":  # the CPU layer: the grouped torch path
            grouped = torch_path.fused_moe_grouped(case["x"], layer.w_gate_up, layer.w_down, case["topk_ids"],
                                                   case["topk_weights"], layer.b_gate_up, layer.b_down, activation)
            assert torch.equal(out, grouped)
            assert_moe_close(out, ref)
        else:
            assert_moe_close(out, ref)


@needs_interpreter
def test_deterministic_mode_takes_fixed_row_tiles_on_every_layer(monkeypatch):
    """`row_tile` set: every layer gives the model's tiled torch path bit for bit (the kernel is
    not launched), so a row's result is the same alone and among batch mates."""
    layers = importlib.import_module("kernels_local.fused_moe.layers")
    monkeypatch.setattr(layers, "fused_moe", lambda *a, **kw: pytest.fail("the kernel ran in deterministic mode"))
    layer = _model_layer(True, "swiglu_oai", torch.bfloat16, seed=2)
    layer.row_tile = 4
    case = make_case(13, 4, 8, seed=5)
    x = case["x"].bfloat16()
    batch = layer(x, case["topk_ids"], case["topk_weights"])
    alone = layer(x[3:4], case["topk_ids"][3:4], case["topk_weights"][3:4])
    assert torch.equal(batch[3], alone[0])
    for name in ("FusedMoE", "FusedMoETritonSm70", "FusedMoETritonSm90", "FusedMoETritonRocm"):
        assert torch.equal(getattr(layers, name).forward(layer, x, case["topk_ids"], case["topk_weights"]), batch)


def test_each_layer_passes_its_tuning_and_the_modules_options(monkeypatch):
    """Guards `COMPILE_SPECS` and `_triton_or_torch` in fused_moe/layers.py: each Triton layer
    launches with the tuning its specs declare, and with the module's weights, biases,
    activation, alpha and limit, so a gpt-oss layer is never run as a plain SwiGLU one."""
    layers = importlib.import_module("kernels_local.fused_moe.layers")
    seen = []
    monkeypatch.setattr(layers, "fused_moe", lambda *a, **kw: seen.append((a, kw)))
    module = _model_layer(True, "swiglu_oai")
    module.alpha, module.limit = 1.5, 5.0
    x, ids, weights = torch.ones(2, HIDDEN), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)
    for name, spec in layers.COMPILE_SPECS.items():
        if name.startswith(("Fp8FusedMoE", "Mxfp4FusedMoE")):  # tests/test_kernels_moe_fp8.py, test_mxfp4_kernel.py
            continue
        getattr(layers, name).forward(module, x, ids, weights)
        args, kw = seen.pop()
        assert kw["tuning"] is spec.args[0], name
        assert args[1] is module.w_gate_up and args[2] is module.w_down, name
        assert args[5] is module.b_gate_up and args[6] is module.b_down and args[7:] == ("swiglu_oai", 1.5, 5.0)


# -- compile specs: every launch the wrapper makes is declared ---------------------------------


def _spec_case(tokens, k, e, h, i, dtype):
    """Zeros of the right shapes (the values do not matter to what is launched); the expert
    count changes no argument type, so realistic widths keep at most 8 experts in memory."""
    e = e if h * i < 10**5 else min(e, 8)
    return dict(x=torch.zeros(tokens, h, dtype=dtype), w_gate_up=torch.zeros(e, 2 * i, h, dtype=dtype),
                w_down=torch.zeros(e, h, i, dtype=dtype), topk_ids=torch.arange(tokens * k).view(tokens, k) % e,
                topk_weights=torch.full((tokens, k), 1 / k))  # fmt: skip


def _launch(monkeypatch, tuning, case):
    """(the recorded launches, each with its runtime argument types as Triton's JIT types them)."""
    kernel = moe._moe_gemm_kernel
    rec = _Recorder("_moe_gemm_kernel")
    monkeypatch.setattr(moe, "_moe_gemm_kernel", rec)
    monkeypatch.setattr(moe, "runs_triton", lambda x: True)
    moe.fused_moe(**case, tuning=tuning)
    monkeypatch.setattr(moe, "_moe_gemm_kernel", kernel)
    types = [[_jit_type(kernel, n, v) for n, v in zip(kernel.arg_names, args, strict=False)]
             for args, _ in rec.launches]
    return rec, types


@pytest.mark.skipif(INTERPRETED, reason="Triton's argument typing is the compiled JIT's: runs in the parent")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h,i", [(2048, 768), (2880, 2880), (72, 40)])  # Qwen3-30B-A3B, gpt-oss-20b, odd
@pytest.mark.parametrize("tokens,k,e", [(1, 1, 4), (1, 8, 128), (3, 4, 32), (32, 2, 8), (33, 8, 128), (200, 4, 32)],
                         ids=str)
def test_declared_specs_cover_every_launch_the_wrapper_makes(monkeypatch, tokens, k, e, h, i, dtype):
    """Guards `compile_specs` and `_UNSPECIALIZED` in fused_moe.py: for every tuning, top-k 1..8
    (top-k 1 would be `constexpr=1` if specialized), 4..128 experts, decode and prefill token
    counts, both activations, with and without biases, each launch (gate_up, then down) is a
    declared spec, constexpr for constexpr and argument type for argument type."""
    name = moe._TRITON_DTYPES[dtype]
    for tuning in moe.TUNINGS.values():
        specs = moe.compile_specs(tuning, moe.Workload(dtype=name, widths=(h, i), max_tokens=max(tokens, 2)))
        declared = {(s.constexprs, s.num_warps, s.num_stages, tuple(t for _, t in s.args)) for s in specs}
        case = _spec_case(tokens, k, e, h, i, dtype)
        for bias, activation in ((False, "silu"), (True, "swiglu_oai"), (True, "silu"), (False, "swiglu_oai"),
                                 (False, "gelu_tanh")):
            biases = dict(b_gate_up=torch.zeros(case["w_gate_up"].shape[:2], dtype=dtype),
                          b_down=torch.zeros(case["w_down"].shape[:2], dtype=dtype)) if bias else {}  # fmt: skip
            rec, types = _launch(monkeypatch, tuning, {**case, **biases, "activation": activation})
            launched = _launched(rec)
            assert [dict(c)["ACTIVATION"] for c, _, _ in launched] == [activation, "none"]
            assert all(dict(c)["HAS_BIAS"] is bias for c, _, _ in launched)
            for (constexprs, warps, stages), arg_types in zip(launched, types, strict=True):
                assert (constexprs, warps, stages, tuple(arg_types)) in declared, (tuning.name, constexprs, arg_types)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_declared_specs_are_the_launches_of_both_buckets_and_nothing_else(monkeypatch, dtype):
    for tuning in moe.TUNINGS.values():
        specs = moe.compile_specs(tuning, moe.Workload(dtype=dtype, widths=(2048, 768), max_tokens=64))
        assert len(specs) == 16  # 2 buckets x (3 activations + down) x 2 bias flags
        configs = {tuning.launch_shape(1, dtype), tuning.launch_shape(64, dtype)}
        assert {(dict(s.constexprs)["BLOCK_M"], s.num_warps) for s in specs} == {(c.block_m, c.num_warps)
                                                                                 for c in configs}
        assert all(s.dot == (None if dtype == "fp32" else "f16") for s in specs)


@pytest.mark.parametrize("device_type,cap,layer", [
    ("cpu", None, "FusedMoE"), ("cuda", (7, 5), "FusedMoE"), ("cuda", (8, 0), "FusedMoETritonSm70"),
    ("cuda", (8, 9), "FusedMoETritonSm70"), ("cuda", (9, 0), "FusedMoETritonSm90"),
    ("cuda", (12, 0), "FusedMoETritonSm90"),
    ("rocm", (9, 4), "FusedMoETritonRocm"), ("rocm", (11, 0), "FusedMoETritonRocm"),
])  # fmt: skip
def test_the_mapping_runs_the_kernel_from_sm80_and_says_why_not_below(device_type, cap, layer):
    from kernels_local.mapping import select

    choice = select(device_type, cap)["FusedMoE"]
    assert (choice.repo, choice.layer) == ("kernels_local/fused_moe", layer)
    if cap == (7, 5):
        assert "FMAs" in choice.reason and "cuBLAS has tensor cores" in choice.reason


def test_tunings_really_differ():
    t = moe.TUNINGS
    assert t["sm90"].launch_shape(1, "bf16").block_m == 64  # wgmma's smallest tile, even for a decode step
    assert t["sm70"].launch_shape(1, "bf16").block_m == 16 and t["sm70"].launch_shape(33, "bf16").block_m == 64
    assert t["sm90"].launch_shape(4096, "bf16").block_m == 128 and t["sm90"].launch_shape(4096, "bf16").num_warps == 8
    assert t["rocm"].launch_shape(33, "bf16").num_stages == 2
    assert t["sm90"].launch_shape(4096, "fp32") == moe.MoEConfig(64, 32, 32, 8, 8, 4)  # FMA tiles


# -- a real GPU --------------------------------------------------------------------------------

GPU_SHAPES = [  # (name, experts, top-k, hidden, intermediate, bias, activation)
    ("Qwen3-30B-A3B", 128, 8, 2048, 768, False, "silu"),
    ("gpt-oss-20b", 32, 4, 2880, 2880, True, "swiglu_oai"),
    ("Gemma-4-26B-A4B", 128, 8, 2816, 704, False, "gelu_tanh"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("name,e,k,h,i,bias,activation", GPU_SHAPES, ids=[s[0] for s in GPU_SHAPES])
def test_compiled_kernel_matches_the_reference_on_real_shapes(name, e, k, h, i, bias, activation, tokens):
    """The tuning `select()` picks for this GPU, compiled, against the reference in bf16, and in
    fp32 tightly (a tf32 dot would be off by ~1e-3)."""
    from kernels_local.mapping import select

    cap = torch.cuda.get_device_capability(0)
    kind = "rocm" if torch.version.hip else "cuda"
    layer = select(kind, cap)["FusedMoE"].layer
    tuning = {"FusedMoETritonSm70": moe.PRE_HOPPER, "FusedMoETritonSm90": moe.HOPPER,
              "FusedMoETritonRocm": moe.ROCM}.get(layer, moe.PRE_HOPPER)  # fmt: skip
    case = make_case(tokens, k, e, h, i, bias=bias, activation=activation, dtype=torch.bfloat16, gain=3.0,
                     device="cuda")  # fmt: skip
    assert_moe_close(moe.fused_moe(**case, tuning=tuning), torch_path.fused_moe_reference(**case))
    small = make_case(tokens, k, e, h, 256, bias=bias, activation=activation, device="cuda")
    assert not torch.backends.cuda.matmul.allow_tf32  # the reference's own fp32 matmuls are exact too
    torch.testing.assert_close(moe.fused_moe(**small, tuning=tuning), torch_path.fused_moe_reference(**small),
                               rtol=1e-4, atol=1e-4)  # fmt: skip
