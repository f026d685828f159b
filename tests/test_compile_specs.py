"""What the preflight compiles, without compiling: every Triton layer declares its launches,
the declared launches are exactly what the wrappers launch, and the limits table agrees with
the fp8 rule. Fast (no Triton compile): the launches are recorded by stand-in kernels."""

from __future__ import annotations

import importlib
import types
from pathlib import Path

import pytest
import torch

from kernels_local.compile_spec import REALISTIC_WIDTHS, CompileSpec, Workload
from kernels_local.mapping import _ENTRIES
from workers.contract import fp8_rule, parse_token
from workers.kernelize.arch_limits import ARCH_LIMITS, arch_limits

ROOT = Path(__file__).resolve().parents[1]


def _layers_module(repo: str):
    return importlib.import_module(f"kernels_local.{repo}.layers")


TRITON_LAYERS = sorted({(e.repo, e.layer_class) for e in _ENTRIES if "triton" in e.variant})


@pytest.mark.parametrize("repo,layer", TRITON_LAYERS)
def test_every_triton_layer_the_mapping_can_select_declares_its_launches(repo, layer):
    specs = _layers_module(repo).COMPILE_SPECS[layer](Workload())
    assert specs and all(isinstance(s, CompileSpec) for s in specs)
    assert len(set(specs)) == len(specs)  # one entry per distinct launch
    for s in specs:
        assert [n for n, _ in s.args] + [n for n, _ in s.constexprs] == list(s.kernel.arg_names)


def test_torch_layers_declare_nothing():
    for e in _ENTRIES:
        if "triton" not in e.variant:
            assert e.layer_class not in _layers_module(e.repo).COMPILE_SPECS


class _Recorder:
    """Stands in for a `@triton.jit` function: records each launch's arguments."""

    def __init__(self, name: str):
        self.__name__ = name
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def _launched(recorder: _Recorder) -> list[tuple[tuple, int, int]]:
    """(constexprs, num_warps, num_stages) of each recorded launch."""
    out = []
    for _, kw in recorder.launches:
        warps, stages = kw.pop("num_warps"), kw.pop("num_stages", 3)
        out.append((tuple(kw.items()), warps, stages))
    return out


def _declared(specs, kernel: str) -> list[tuple[tuple, int, int]]:
    return [(s.constexprs, s.num_warps, s.num_stages) for s in specs if s.name == kernel]


@pytest.mark.parametrize("width", [48, 256, 688, 4096, 16384])
def test_rmsnorm_and_silu_specs_are_what_the_wrappers_launch(monkeypatch, width):
    """Guards the shared `launch_shape` calls in rmsnorm.py / silu_and_mul.py: a wrapper that
    launched a shape its specs do not declare would run a kernel the preflight never saw."""
    for repo, module, kernel, call in (
        ("rmsnorm", "rmsnorm", "_rms_norm_kernel", lambda m, t: m.rms_norm(torch.ones(3, width), torch.ones(width),
                                                                            1e-6, t)),
        ("activation", "silu_and_mul", "_silu_and_mul_kernel", lambda m, t: m.silu_and_mul(torch.ones(3, 2 * width),
                                                                                          t)),
    ):  # fmt: skip
        mod = importlib.import_module(f"kernels_local.{repo}.{module}")
        for tuning in mod.TUNINGS.values():
            rec = _Recorder(kernel)
            monkeypatch.setattr(mod, kernel, rec)
            monkeypatch.setattr(mod, "runs_triton", lambda x: True)
            call(mod, tuning)
            declared = _declared(mod.compile_specs(tuning, Workload(widths=(width,))), kernel)
            assert _launched(rec) == declared, (repo, tuning.name, width)


@pytest.mark.parametrize("native,fmt", [(False, "e4m3fn"), (True, "e4m3fn"), (True, "e4m3fnuz")])
@pytest.mark.parametrize("tokens", [1, 16, 40, 200])
def test_fp8_linear_specs_are_what_the_wrapper_launches(monkeypatch, native, fmt, tokens):
    gemm_mod = importlib.import_module("kernels_local.fp8_linear.fp8_linear")  # the package exports a function
    quant_mod = importlib.import_module("kernels_local.fp8_linear.quant")

    k, n = 688, 256
    gemm, quant = _Recorder("_fp8_linear_kernel"), _Recorder("_quantize_rows_kernel")
    monkeypatch.setattr(gemm_mod, "_fp8_linear_kernel", gemm)
    monkeypatch.setattr(quant_mod, "_quantize_rows_kernel", quant)
    monkeypatch.setattr(gemm_mod, "runs_triton", lambda x: True)
    storage = getattr(torch, "float8_e4m3fn" if fmt == "e4m3fn" else "float8_e4m3fnuz") if native else torch.uint8
    bias = torch.zeros(n)
    for tuning in gemm_mod.TUNINGS.values():
        gemm.launches.clear(), quant.launches.clear()
        w = torch.zeros(n, k, dtype=storage)
        gemm_mod.fp8_linear(torch.ones(tokens, k), w, torch.ones(n), bias, native=native, fmt=fmt, tuning=tuning)
        workload = Workload(widths=(k,), max_tokens=tokens, fp8_fmt=fmt)
        specs = gemm_mod.compile_specs(tuning, workload, native=native)
        assert _launched(gemm)[0] in _declared(specs, "_fp8_linear_kernel"), tuning.name
        assert _launched(quant) == _declared(specs, "_quantize_rows_kernel")


@pytest.mark.parametrize("repo,launcher", [("rmsnorm", "rms_norm"), ("activation", "silu_and_mul"),
                                           ("fp8_linear", "fp8_linear")])  # fmt: skip
def test_each_layer_passes_the_tuning_its_specs_declare(monkeypatch, repo, launcher):
    """Guards the `COMPILE_SPECS` tables: a layer whose forward passed another tuning (or NATIVE
    flag) than its entry would be preflighted with the wrong tile shapes."""
    layers = _layers_module(repo)
    seen = {}
    monkeypatch.setattr(layers, launcher, lambda *a, **kw: seen.update(tuning=kw.get("tuning", a[-1]),
                                                                         native=kw.get("native")))
    module = torch.nn.Module()
    module.weight, module.variance_epsilon = torch.ones(4), 1e-6
    module.qweight, module.weight_scale, module.bias, module.fp8_fmt = torch.zeros(4, 4), torch.ones(4), None, "e4m3fn"
    for name, spec in layers.COMPILE_SPECS.items():
        if name.startswith("Fp8CheckpointLinear"):  # other launchers: tests/test_kernels_fp8_checkpoint.py
            continue
        module.fp8_native = spec.keywords.get("native", False)
        getattr(layers, name).forward(module, torch.ones(2, 4))
        assert seen["tuning"] is spec.args[0], name
        if repo == "fp8_linear":
            assert seen["native"] is spec.keywords["native"], name


def _jit_type(kernel, name: str, value) -> str:
    """The type Triton's JIT gives argument `name` of `kernel` for `value`, in the specs'
    notation (`*bf16:16`, `i32:16`, `i32`; `constexpr=1` for an integer it makes a constant)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    param = next(p for p in kernel.params if p.name == name)
    ty, key = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize,
                                     not param.do_not_specialize_on_alignment)  # fmt: skip
    if ty == "constexpr":
        return f"constexpr={key}"
    return f"{ty}:16" if key == "D" else ty


PAGED_SHAPES = [  # (query heads, kv heads, head dim, block size, pool blocks, lengths)
    (32, 8, 128, 16, 4096, [1, 300, 17]),  # Llama 3 8B, a long table
    (4, 4, 64, 1, 64, [16]),  # MHA, a block per position, one row of 16 blocks
    (14, 2, 64, 8, 7, [5, 40]),  # Qwen2's group of 7, an odd pool
    (8, 1, 256, 4, 33, [9]),  # MQA, head dim 256, one row
    (20, 4, 80, 2, 100, [3, 4, 50]),  # head dim 80 pads to 128
    (32, 4, 512, 16, 64, [1, 40]),  # Gemma 4's global layers: head dim 512, more warps pre-Hopper
]


PAGED_OPTIONS = [  # (window, softcap, scale): a full layer, Gemma 2's cap, windows of 1, 16 and beyond the rows
    (None, None, None),
    (0, 0.0, None),  # the "off" spellings
    (None, 50.0, None),
    (1, None, None),
    (16, 30.0, 144**-0.5),
    (4096, None, 0.0625),
]


def _paged_launch(monkeypatch, tuning, shape, window=None, softcap=None, scale=None):
    """(the recorded launch, the type Triton's JIT gives each runtime argument, the arguments by name)."""
    mod = importlib.import_module("kernels_local.paged_attention.paged_attention")
    kernel = mod._paged_decode_kernel
    hq, hkv, d, bs, nb, lens = shape
    monkeypatch.setattr(mod, "runs_triton", lambda x: True)
    rec = _Recorder("_paged_decode_kernel")
    monkeypatch.setattr(mod, "_paged_decode_kernel", rec)
    kv = torch.zeros(2, hkv, nb, bs, d, dtype=torch.bfloat16)
    tables = torch.zeros(len(lens), -(-max(lens) // bs), dtype=torch.int64)
    q = torch.zeros(len(lens), hq, d, dtype=torch.bfloat16)
    mod.paged_decode(q, kv, tables, torch.tensor(lens), max(lens), tuning, window=window, softcap=softcap, scale=scale)
    monkeypatch.setattr(mod, "_paged_decode_kernel", kernel)
    (args, _), = rec.launches
    types_ = [_jit_type(kernel, name, value) for name, value in zip(kernel.arg_names, args, strict=False)]
    return rec, types_, dict(zip(kernel.arg_names, args, strict=False))


@pytest.mark.parametrize("hq,hkv,d,bs,nb,lens", PAGED_SHAPES)
def test_paged_attention_specs_are_what_the_wrapper_launches(monkeypatch, hq, hkv, d, bs, nb, lens):
    """Guards `compile_specs` in paged_attention.py (and its `do_not_specialize` list): the
    wrapper's launch has the declared constexprs and warps, and every runtime argument the
    type Triton's JIT compiles it as, whatever the block size, group, pool and block table
    width. An integer left to specialization (a block table one block wide is `constexpr=1`,
    a width of 16 is `i32:16`) would run a variant the preflight never compiled."""
    mod = importlib.import_module("kernels_local.paged_attention.paged_attention")
    for tuning in mod.TUNINGS.values():
        rec, launched, _ = _paged_launch(monkeypatch, tuning, (hq, hkv, d, bs, nb, lens))
        specs = mod.compile_specs(tuning, Workload(head_dims=(d,)))
        assert _launched(rec) == _declared(specs, "_paged_decode_kernel"), tuning.name
        assert launched == [t for _, t in specs[0].args], tuning.name


@pytest.mark.parametrize("window,softcap,scale", PAGED_OPTIONS)
def test_paged_attention_specs_cover_every_layer_option(monkeypatch, window, softcap, scale):
    """Guards the runtime `window`, `softcap` and `scale` arguments of `_paged_decode_kernel`
    (and `window` in `_UNSPECIALIZED`): for head dim 256 (Gemma), with the cap on or off and
    the window on or off, every launch the wrapper makes is one its specs declare for
    `head_dims=(256,)`, argument type for argument type. A window left to specialization (1 is
    `constexpr=1`, 16 is `i32:16`) or a cap turned constexpr without its spec would run a
    variant the preflight never compiled. The options reach the kernel as the layer set them."""
    mod = importlib.import_module("kernels_local.paged_attention.paged_attention")
    for tuning in mod.TUNINGS.values():
        rec, launched, args = _paged_launch(monkeypatch, tuning, (8, 4, 256, 16, 64, [1, 33, 100]), window, softcap,
                                            scale)  # fmt: skip
        specs = mod.compile_specs(tuning, Workload(head_dims=(256,)))
        (declared,) = [s for s in specs if s.name == "_paged_decode_kernel"]
        assert _launched(rec) == [(declared.constexprs, declared.num_warps, declared.num_stages)], tuning.name
        assert dict(declared.constexprs) == {"TILE": tuning.launch_shape(256)[0], "HEAD_DIM": 256}
        assert launched == [t for _, t in declared.args], (tuning.name, window, softcap)
        assert args["window"] == (window or mod.FULL_WINDOW) and args["softcap"] == (softcap or 0.0)
        assert args["scale"] == (256**-0.5 if scale is None else scale)


def test_each_paged_attention_layer_passes_the_tuning_and_options_its_module_has(monkeypatch):
    """Guards `_triton_or_torch` and `_options` in paged_attention/layers.py: each Triton layer
    passes its `COMPILE_SPECS` tuning and the model module's `sliding_window`, `softcap`, `scale`
    and `sinks` (None when the module has none of them) to the kernel, and the same options to
    `decode.attend` on the torch path, so a Gemma layer is never run as a full, uncapped one nor
    a gpt-oss layer without its sinks."""
    layers = _layers_module("paged_attention")
    kernel, torch_path = [], []
    monkeypatch.setattr(layers, "paged_decode", lambda *a, **kw: kernel.append(kw))
    decode = types.SimpleNamespace(block_tables=None, seq_lens=None, max_len=1,
                                   attend=lambda q, kv, *options: torch_path.append(options))  # fmt: skip
    gemma = torch.nn.Module()
    gemma.sliding_window, gemma.softcap, gemma.scale = 4096, 50.0, 144**-0.5
    gpt_oss = torch.nn.Module()
    gpt_oss.sliding_window, gpt_oss.sinks = 128, torch.nn.Parameter(torch.ones(2))
    q, kv = torch.ones(1, 2, 4), torch.ones(2, 1, 1, 1, 4)
    cases = ((torch.nn.Module(), (None, None, None, None)), (gemma, (4096, 50.0, 144**-0.5, None)),
             (gpt_oss, (128, None, None, gpt_oss.sinks)))
    for module, options in cases:
        for name, spec in layers.COMPILE_SPECS.items():
            monkeypatch.setattr(layers, "runs_triton", lambda x: True)
            getattr(layers, name).forward(module, q, kv, decode)
            kw = kernel.pop()
            assert kw["tuning"] is spec.args[0], name
            assert (kw["window"], kw["softcap"], kw["scale"], kw["sinks"]) == options, name
            monkeypatch.setattr(layers, "runs_triton", lambda x: False)
            getattr(layers, name).forward(module, q, kv, decode)
            assert torch_path.pop() == options, name
        layers.PagedAttention.forward(module, q, kv, decode)
        assert torch_path.pop() == options


GATED_DELTA_SHAPES = [  # (key heads, value heads, head dim of keys and values, tokens)
    (16, 32, 128, 9),  # Qwen3.5 / Qwen3.6 and Qwen3-Next's DeltaNets
    (2, 4, 16, 1),  # the tiny test checkpoints, one row
    (1, 2, 80, 40),  # a head dim that is not a multiple of 16
    (4, 8, 256, 3),
    (2, 4, 512, 2),  # the decode kernel's state slice narrowed to fit its registers
]


@pytest.mark.parametrize("hk,hv,d,tokens", GATED_DELTA_SHAPES)
def test_gated_delta_specs_are_what_the_wrappers_launch(monkeypatch, hk, hv, d, tokens):
    """Guards `compile_specs` in gated_delta.py (and its `do_not_specialize` list): both kernels'
    launches have the declared constexprs and warps, and every runtime argument the type
    Triton's JIT compiles it as, for q, k, v sliced from one packed projection (any row
    stride), any number of rows, spans and slots."""
    mod = importlib.import_module("kernels_local.gated_delta.gated_delta")
    monkeypatch.setattr(mod, "runs_triton", lambda x: True)
    packed = torch.zeros(tokens, 2 * hk * d + hv * d + 3, dtype=torch.bfloat16)  # q | k | v | 3 more columns
    q, k = (packed[:, i * hk * d : (i + 1) * hk * d].unflatten(-1, (hk, d)) for i in range(2))
    v = packed[:, 2 * hk * d : 2 * hk * d + hv * d].unflatten(-1, (hv, d))
    g, beta, state = torch.zeros(tokens, hv), torch.zeros(tokens, hv, dtype=torch.bfloat16), torch.zeros(3, hv, d, d)
    rows, out = torch.arange(tokens), torch.empty_like(v)
    for tuning in mod.TUNINGS.values():
        specs = {s.name: s for s in mod.compile_specs(tuning, Workload(dtype="bf16", head_dims=(d,)))}
        for name, launch, where in (
            ("_gated_delta_step_kernel", mod.gated_delta_step, (rows, rows % 3)),
            ("_gated_delta_chunk_kernel", mod.gated_delta_chunks, (torch.tensor([[0, tokens, 2]]),)),
        ):
            kernel, rec = getattr(mod, name), _Recorder(name)
            monkeypatch.setattr(mod, name, rec)
            launch(q, k, v, g, beta, state, *where, out, tuning)
            monkeypatch.setattr(mod, name, kernel)
            (args, _), = rec.launches
            assert _launched(rec) == _declared(specs.values(), name), (tuning.name, name)
            launched = [_jit_type(kernel, n, a) for n, a in zip(kernel.arg_names, args, strict=False)]
            assert launched == [t for _, t in specs[name].args], (tuning.name, name)


def test_each_gated_delta_layer_passes_the_tuning_its_specs_declare(monkeypatch):
    """Guards the `COMPILE_SPECS` table of gated_delta/layers.py: a layer whose forward passed
    another tuning than its entry would be preflighted with the wrong chunk and tile shapes."""
    layers = _layers_module("gated_delta")
    seen = []
    monkeypatch.setattr(layers, "runs_triton", lambda x: True)
    for launcher in ("gated_delta_step", "gated_delta_chunks"):
        monkeypatch.setattr(layers, launcher, lambda *a, name=launcher: seen.append((name, a[-1])))
    batch = types.SimpleNamespace(decode=types.SimpleNamespace(rows=torch.arange(1)),
                                  states=types.SimpleNamespace(decode_slots=torch.zeros(1, dtype=torch.int64),
                                                               prefills=torch.zeros(1, 3, dtype=torch.int64)))
    module = types.SimpleNamespace(token_by_token=False)
    for name, spec in layers.COMPILE_SPECS.items():
        seen.clear()
        getattr(layers, name).forward(module, *(torch.zeros(1, 1, 1),) * 5, torch.zeros(1, 1, 1, 1), batch)
        assert [n for n, _ in seen] == ["gated_delta_step", "gated_delta_chunks"], name
        assert all(tuning is spec.args[0] for _, tuning in seen), name


def test_default_workload_covers_every_realistic_launch():
    assert REALISTIC_WIDTHS == (256, 512, 1024, 2048, 4096, 8192, 16384)
    assert Workload().head_dims == (64, 128, 256, 512)
    assert Workload(max_tokens=100).token_counts() == (1, 2, 4, 8, 16, 32, 64, 100)
    with pytest.raises(ValueError, match="positive head dims, got `\\(\\)`"):
        Workload(head_dims=())
    with pytest.raises(ValueError, match="`fp16x`"):
        Workload(dtype="fp16x")
    with pytest.raises(ValueError, match="`e5m2`"):
        Workload(fp8_fmt="e5m2")


# -- the limits table -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(ARCH_LIMITS))
def test_limits_table_rows_have_sources_and_agree_with_the_fp8_rule(arch):
    row = ARCH_LIMITS[arch]
    assert row.source and ("CUDA C++ Programming Guide" in row.source or "ROCm docs" in row.source)
    assert row.warp_size == (32 if arch.startswith("sm_") else 64)
    device_type, cap = parse_token(arch)
    decision = fp8_rule(device_type, cap)
    assert row.fp8 == (decision.fmt if decision.native else None), arch
    assert (row.fp8_instruction is None) == (not decision.native)


def test_the_table_figures():
    kib = 1024
    shared = {a: r.shared_bytes // kib for a, r in ARCH_LIMITS.items()}
    assert shared == {"sm_70": 96, "sm_75": 64, "sm_80": 163, "sm_86": 99, "sm_87": 163, "sm_89": 99, "sm_90": 227,
                      "sm_100": 227, "sm_103": 227, "sm_120": 99, "gfx90a": 64, "gfx942": 64, "gfx950": 160}


def test_gfx950_is_ocp_e4m3fn_not_fnuz():
    """Guards `ROCM_OCP_FP8_CAPABILITY` in workers/contract/fp8_rule.py: MI355 (CDNA4) fp8
    matrix cores take OCP e4m3fn; only CDNA3 takes FNUZ."""
    assert ARCH_LIMITS["gfx950"].fp8 == "e4m3fn" and ARCH_LIMITS["gfx942"].fp8 == "e4m3fnuz"
    from kernels_local.mapping import select
    from workers.quant.fp8_convention import NATIVE_E4M3, NATIVE_E4M3_FNUZ, choose_fp8

    assert choose_fp8("rocm", parse_token("gfx950")[1])[0] == NATIVE_E4M3
    assert choose_fp8("rocm", parse_token("gfx950")[1])[0].storage_dtype == torch.float8_e4m3fn
    assert choose_fp8("rocm", parse_token("gfx942")[1])[0] == NATIVE_E4M3_FNUZ
    assert "OCP e4m3fn" in select("rocm", (9, 5))["Fp8Linear"].reason
    assert "e4m3fnuz" in select("rocm", (9, 4))["Fp8Linear"].reason


@pytest.mark.parametrize("arch,row", [("sm_121", "sm_120"), ("sm_72", "sm_70"), ("sm_101", "sm_100"),
                                      ("gfx941", None), ("gfx1100", None), ("sm_61", None), ("cpu", None)])  # fmt: skip
def test_an_architecture_without_a_row_reads_its_family_or_none(arch, row):
    found = arch_limits(arch)
    assert (found.arch if found else None) == row


def test_repositories_import_only_the_spec_module_from_the_project():
    """The spec module, the CPU kernels' build helper and the experts' pair grouping (expert_pairs.py) are the
    only things repositories import from outside themselves: no repository imports another."""
    for repo in ("rmsnorm", "activation", "fp8_linear", "paged_attention", "fused_moe", "gated_delta", "rotary",
                 "panel_linear", "sampling", "gguf_linear"):
        text = "\n".join(p.read_text() for p in (ROOT / "kernels_local" / repo).glob("*.py"))
        outside = {line.split()[1] for line in text.splitlines() if line.startswith(("import ", "from "))
                   and line.split()[1].startswith("kernels_local")}  # fmt: skip
        assert outside <= {"kernels_local.compile_spec", "kernels_local.cpp_build", "kernels_local.expert_pairs"}, \
            (repo, outside)
