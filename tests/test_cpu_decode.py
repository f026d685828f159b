"""The CPU decode kernel (kernels_local/paged_attention/cpu.py) against the torch path it replaces.

The kernel reads each row's blocks in place; the torch path (`PagedRows.attend`: gathered K/V,
scores and softmax in fp32) is the reference. Compared over group sizes, head dims, block
sizes, lengths (one position, a block's edge, the whole table), windows, soft-caps, scales and
gpt-oss's sinks, in every dtype; inside a compiled graph; through the model's step with every
family option it carries (sliding layers, sinks); and where the worker decides to use it.
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch

from kernels_local.paged_attention import cpu as cpu_decode
from workers.kv.batch import ForwardBatch, SeqChunk
from workers.kv.mirror import DecodeMirror
from workers.kv.paged import PagedRows

# Where a C++ compiler exists (CI, and every host Inductor compiles on), the kernel must load.
needs_compiler = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                    reason="no C++ compiler on this host: the torch path serves")


@pytest.fixture(scope="module")
def kernel():
    state = cpu_decode.load()
    assert state.available, state.reason
    return state


def _rows(n: int, tables: torch.Tensor, lens: torch.Tensor, in_place: bool) -> PagedRows:
    return PagedRows(rows=torch.arange(n), rows_start=0, block_tables=tables, seq_lens=lens,
                     max_len=tables.shape[1] * 16, mask=None, view=None, in_place=in_place)


TOL = {torch.float32: (2e-5, 2e-6), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "kv_heads", "group", "dim", "block", "width"),
                         [(5, 2, 2, 64, 16, 6), (3, 4, 1, 32, 8, 9), (2, 1, 4, 128, 16, 3), (1, 2, 3, 64, 16, 1),
                          (2, 2, 2, 36, 8, 4)])  # 36: no whole vectors (the staged path)
def test_the_kernel_is_the_torch_path(kernel, dtype, n, kv_heads, group, dim, block, width):
    g = torch.Generator().manual_seed(n * 100 + dim)
    kv = torch.randn(2, kv_heads, 64, block, dim, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(64, generator=g)[:width] for _ in range(n)])  # blocks anywhere
    lens = torch.randint(1, width * block + 1, (n,), generator=g)
    lens[0] = 1  # one position
    lens[-1] = width * block  # the whole table (its last block's edge)
    q = torch.randn(n, kv_heads * group, dim, generator=g).to(dtype)
    sinks = torch.randn(kv_heads * group, generator=g)
    ref = PagedRows(rows=torch.arange(n), rows_start=0, block_tables=tables, seq_lens=lens, max_len=width * block,
                    mask=None, view=None)
    fast = replace(ref, in_place=True)
    rtol, atol = TOL[dtype]
    for options in ({}, {"window": 7}, {"window": 1}, {"softcap": 5.0}, {"scale": 0.3}, {"sinks": sinks},
                    {"window": 2 * block + 3, "sinks": sinks, "softcap": 3.0}):
        want = ref.attend(q, kv, **options).float()
        got = fast.attend(q, kv, **options)
        assert got.dtype == dtype and got.shape == q.shape
        torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol, msg=lambda m, o=options: f"{o}: {m}")


@needs_compiler
def test_an_empty_batch_and_a_bad_pool_are_clear(kernel):
    kv = torch.randn(2, 2, 8, 16, 64)
    empty = cpu_decode.paged_decode_cpu(torch.empty(0, 4, 64), kv, torch.empty(0, 1, dtype=torch.int64),
                                        torch.empty(0, dtype=torch.int64), 0, 0.125, 0.0, None)
    assert empty.shape == (0, 4, 64)
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_decode.paged_decode_cpu(torch.randn(1, 4, 64, dtype=torch.bfloat16), kv,
                                    torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 0, 0.125,
                                    0.0, None)


@needs_compiler
def test_a_compiled_graph_calls_the_kernel_as_one_op(kernel):
    """Dynamo keeps the kernel opaque (its fake, registered at load, gives the output's shape): the
    compiled attention is the eager one, and the graph holds the C++ op itself, not a gather nor a
    Python custom op around it."""
    from torch._dynamo.testing import CompileCounterWithBackend

    g = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 2, 32, 16, 64, generator=g)
    tables = torch.randint(0, 32, (4, 5), generator=g)
    lens = torch.tensor([1, 17, 64, 80])
    q = torch.randn(4, 4, 64, generator=g)
    counter = CompileCounterWithBackend("aot_eager")
    rows = _rows(4, tables, lens, True)
    compiled = torch.compile(lambda q, kv: rows.attend(q, kv, window=40), backend=counter, fullgraph=True)
    torch.testing.assert_close(compiled(q, kv), rows.attend(q, kv, window=40))
    assert counter.frame_count == 1
    (graph,) = counter.graphs
    code = str(graph.code)
    assert "hetserve_cpu.paged_decode" in code and "paged_decode_cpu" not in code and "index_select" not in code


@needs_compiler
@pytest.mark.parametrize("case", ["llama", "gemma3", "gpt_oss"])
def test_the_models_decode_reads_in_place_as_its_mirror_does(kernel, tmp_path, monkeypatch, case):
    """A family's decode steps (Gemma 3's sliding layers; gpt-oss's sinks, biases, alternating
    windows) give the same fp32 logits through the kernel as through the torch path."""
    from tests.family_checkpoints import make_family_checkpoint
    from workers.model.loader import load_model

    lm = load_model(make_family_checkpoint(case, tmp_path / case), "float32")
    prompts = [[3 + (7 * r + i) % 200 for i in range(5 + 11 * r)] for r in range(3)]  # 5, 16 and 27 tokens

    def run(in_place: bool) -> list[torch.Tensor]:
        kv = lm.model.new_kv_pool(64, 16)
        windows = getattr(kv, "windows", (None,))
        mirror = None if in_place or windows[0] is not None else DecodeMirror(kv)
        tables = [list(range(8 * r, 8 * r + 8)) for r in range(len(prompts))]
        out = []
        with torch.inference_mode():
            for r, ids in enumerate(prompts):
                batch = ForwardBatch.build([(SeqChunk(0, len(ids), tables[r], key=r), ids)], 16, windows=windows)
                lm.model.step(batch, kv)
            pos = [len(p) for p in prompts]
            for step in range(20):  # past the sliding window (gemma3's and gpt-oss's test configs)
                items = [(SeqChunk(pos[r], 1, tables[r], key=r), [5 + r + step]) for r in range(len(prompts))]
                batch = ForwardBatch.build(items, 16, mirror=mirror, windows=windows, in_place=in_place)
                out.append(lm.model.step(batch, kv))
                pos = [p + 1 for p in pos]
        return out

    import workers.kv.batch as batch_module

    calls = []
    monkeypatch.setattr(batch_module, "attend_in_place",
                        lambda *a, **k: calls.append(1) or cpu_decode.attend_in_place(*a, **k))
    fast = run(True)
    assert len(calls) == 20 * lm.config.num_hidden_layers  # every decode layer of every step, through the kernel
    windows = [w for w in lm.config.layer_windows if w is not None]
    assert case == "llama" or (windows and min(windows) < 27 + 20)  # sliding layers that slide here
    for got, want in zip(fast, run(False), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rows_read_in_place_need_no_mirror():
    """Guards `ForwardBatch.build`'s refusal and the runner's choice: with `in_place` no mirror is kept."""
    from workers.engine.runner import ModelRunner
    from workers.kv.pool import KVPool

    pool = KVPool(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="need no DecodeMirror"):
        ForwardBatch.build([(SeqChunk(3, 1, [0], key=0), [1])], 4, mirror=DecodeMirror(pool), in_place=True)
    assert ModelRunner(None, pool, "cpu", in_place=True).mirror is None
    assert ModelRunner(None, pool, "cpu").mirror is not None


def test_turned_off_the_torch_path_serves_and_says_why(monkeypatch):
    monkeypatch.setenv(cpu_decode.ENV_CPU_DECODE, "off")
    cpu_decode.load.cache_clear()
    try:
        state = cpu_decode.load()
        assert not state.available and "off" in state.reason
        assert not cpu_decode.in_place("cpu")
        with pytest.raises(RuntimeError, match="not available"):
            cpu_decode.paged_decode_cpu(torch.randn(1, 2, 8), torch.randn(2, 1, 4, 4, 8),
                                        torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 0, 0.3,
                                        0.0, None)
    finally:
        monkeypatch.delenv(cpu_decode.ENV_CPU_DECODE)
        cpu_decode.load.cache_clear()


def test_the_build_flags_follow_the_cpus_vector_instructions(monkeypatch):
    avx512 = frozenset("avx2 fma f16c avx512f avx512dq avx512vl avx512bw".split())
    monkeypatch.setattr(cpu_decode, "cpu_flags", lambda: avx512)
    flags, name = cpu_decode._flags()
    assert name == "avx512" and "-DCPU_CAPABILITY_AVX512" in flags
    monkeypatch.setattr(cpu_decode, "cpu_flags", lambda: frozenset("avx2 fma f16c".split()))
    assert cpu_decode._flags()[1] == "avx2" and "-DCPU_CAPABILITY_AVX2" in cpu_decode._flags()[0]
    monkeypatch.setattr(cpu_decode, "cpu_flags", lambda: None)  # not Linux, not x86: no vector flags
    assert cpu_decode._flags() == (["-O3", "-fopenmp-simd"], "scalar")
