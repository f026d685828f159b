"""The compiled decode step (workers/engine/compiled.py, `--compile auto|on|off`).

Engine-level tests build the runner in-process on the embedded model in fp32 and trace its
step per bucket with `torch.compile(..., backend="aot_eager")`: the same full graph, buckets,
pad rows, scratch blocks and mixed steps as a worker runs, without Inductor's C++ code
generation (minutes on two shared cores). The `slow` tests run real Inductor once on a
2-layer checkpoint and start real worker processes with `--compile on`.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from server.config.compile import AUTO, compile_from_args
from server.errors import UsageError
from tests.checkpoints import default_model_dir
from workers.contract import STARTUP_STEPS, cpu_device
from workers.engine.compiled import (
    CompiledDecode,
    CompileDecision,
    bucket_for,
    decide,
    decode_buckets,
    scheduler_shapes,
    scratch_groups,
    unfit_reason,
    warm_or_eager,
)
from workers.engine.core import Engine
from workers.engine.runner import ModelRunner
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.warm_caches import ENV_INDUCTOR_CACHE_DIR, use_inductor_cache
from workers.kv.batch import ForwardBatch, SeqChunk
from workers.kv.groups import same_blocks
from workers.kv.pool import KVPool, layer_shapes
from workers.model.loader import load_model
from workers.model.rope import RopeSpec
from workers.sampling.params import SamplingParams

MAX_BATCH = 4
BLOCKS, BLOCK = 48, 16
PROMPTS = ["Hello there, how are you", "The quick brown fox jumps over the lazy dog and runs far away from it",
           "1, 2, 3,", "Once upon a time", "def main():\n", "What is the capital of France?"]
# new tokens per request: different lengths, so one request ends while the others decode and the
# next one's prompt joins their step (a step mixing decodes with a prompt chunk)
NEW_TOKENS = [20, 6, 14, 9, 12, 7]


# -- helpers ---------------------------------------------------------------------------------


def make_engine(lm, compiled: str | None, buckets=None, dynamo_backend="aot_eager", in_place: bool = False,
                warm: bool = True):
    """An engine of `MAX_BATCH` sequences; `compiled`: None (eager, the CPU mirror as a worker
    with --compile off runs), "inductor" or "cuda-graphs" (then `dynamo_backend` / a stand-in);
    `in_place`: decode rows through the CPU kernel (kernels_local/paged_attention/cpu.py), as a CPU worker runs them."""
    groups = same_blocks(lm.config.layer_windows, BLOCKS, layer_shapes(lm.config))
    if compiled:
        groups = scratch_groups(groups)
    pool = KVPool.for_config(lm.config, BLOCKS, BLOCK, lm.dtype, "cpu", groups)
    shapes = scheduler_shapes(pool) if compiled else pool.group_shapes
    decode = None
    if compiled:
        decode = CompiledDecode(lm.model, pool, "cpu", buckets or decode_buckets(MAX_BATCH), compiled,
                                graphs=StandInGraphs(), dynamo_backend=dynamo_backend, in_place=in_place)
        if warm:
            decode.warm()
    config = SchedulerConfig(MAX_BATCH, lm.config.context_length, shapes[0][1], BLOCK, 2048, False,
                             eos_token_ids=(), kv_groups=shapes)
    return Engine(ModelRunner(lm.model, pool, "cpu", compiled=decode, in_place=in_place), Scheduler(config),
                  lm.tokenizer, max_queue=64)


def serve(engine, lm, n: int) -> list[list[int]]:
    """The first `n` prompts' greedy tokens, submitted together (at most MAX_BATCH run at once)."""
    streams = [engine.submit(lm.tokenizer.encode(p).ids, SamplingParams.create(max_new_tokens=k))
               for p, k in zip(PROMPTS[:n], NEW_TOKENS[:n], strict=True)]
    while engine.step():
        pass
    return [[e.token_id for e in s.events] for s in streams]


class StepSpy:
    """Which forwards each engine step ran: ("compiled", rows) and ("eager", chunks) entries."""

    def __init__(self, runner: ModelRunner) -> None:
        self.steps: list[list[tuple[str, int]]] = []
        execute, run, forward = runner.execute, runner.compiled.run, runner._forward

        def spy_execute(out):
            self.steps.append([])
            return execute(out)

        def spy_run(chunks):
            self.steps[-1].append(("compiled", len(chunks)))
            return run(chunks)

        def spy_forward(chunks, *a, **k):
            self.steps[-1].append(("eager", len(chunks)))
            return forward(chunks, *a, **k)

        runner.execute, runner.compiled.run, runner._forward = spy_execute, spy_run, spy_forward

    def kinds(self) -> list[set[str]]:
        return [{kind for kind, _ in step} for step in self.steps]


class StandInGraphs:
    """CUDA graphs' contract on the CPU: `capture(fn)` runs `fn` once and returns a replay that
    writes `fn`'s new output into the first output's memory (as a replay overwrites it)."""

    def __init__(self) -> None:
        self.captured = 0

    def capture(self, fn):
        self.captured += 1
        out = fn()

        def replay():
            out.copy_(fn())
            return out

        return replay


def chunk(token: int, pos: int, table: list[int]):
    """A one-token sampling chunk as the scheduler hands it to the runner."""
    return SimpleNamespace(token_ids=[token], start_pos=pos, block_table=table, samples=True,
                           seq=SimpleNamespace(group_tables=(), uid=pos, rope_len=0, state_slot=-1))


def eager_logits(lm, pool, chunks) -> torch.Tensor:
    items = [(SeqChunk(c.start_pos, 1, c.block_table), c.token_ids) for c in chunks]
    with torch.inference_mode():
        return lm.model.step(ForwardBatch.build(items, pool.block_size, "cpu"), pool)


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm():
    torch.set_num_threads(1)
    return load_model(default_model_dir(), "float32")


@pytest.fixture(scope="module")
def eager_tokens(lm):
    engine = make_engine(lm, None)
    return {n: serve(engine, lm, n) for n in (1, 3, 5)}


@pytest.fixture(scope="module")
def compiled_engine(lm):
    return make_engine(lm, "inductor")


# -- the decision and its pieces -------------------------------------------------------------


def test_buckets_are_powers_of_two_below_max_batch_then_max_batch():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(4) == (1, 2, 4)
    assert decode_buckets(5) == (1, 2, 4, 5)
    assert decode_buckets(32) == (1, 2, 4, 8, 16, 32)
    assert [bucket_for(n, (1, 2, 4)) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]
    with pytest.raises(ValueError, match="`max_batch` must be >= 1, got `0`"):
        decode_buckets(0)


def test_decision_per_mode_device_and_deterministic():
    model = SimpleNamespace(step=None, config=SimpleNamespace())
    cpu = decide("auto", "cpu", False, False, model)
    assert (cpu.enabled, cpu.backend) == (True, "inductor")
    gpu = decide("auto", "cuda", False, False, model)
    assert (gpu.enabled, gpu.backend) == (True, "cuda-graphs")
    simulated = decide("auto", "cpu", True, False, model)  # a simulated GPU runs on the CPU, eager under auto
    assert not simulated.enabled and "simulated" in simulated.reason
    forced = decide("on", "cpu", True, False, model)
    assert (forced.enabled, forced.backend, forced.mode) == (True, "inductor", "on")
    assert not decide("off", "cuda", False, False, model).enabled
    for mode in ("on", "auto"):  # deterministic mode takes precedence over --compile on
        d = decide(mode, "cpu", False, True, model)
        assert not d.enabled and d.backend is None and "deterministic" in d.reason
    with pytest.raises(ValueError, match=r"Unknown compile mode `fast`\. Allowed: auto, on, off"):
        decide("fast", "cpu", False, False, model)


@pytest.mark.parametrize("model, why", [
    (SimpleNamespace(step=None, config=SimpleNamespace(), rope_threshold=32,
                     rope_specs=(RopeSpec("dynamic", params=(("factor", 2.0),)),)), "dynamic rotary"),
    (SimpleNamespace(step=None, config=SimpleNamespace(state_layers=(0,))), "recurrent state"),
    (SimpleNamespace(), "no `Transformer.step`"),
])
def test_a_model_the_step_cannot_compile_runs_eager_under_auto_and_refuses_on(model, why):
    assert why in unfit_reason(model)
    auto = decide("auto", "cpu", False, False, model)
    assert not auto.enabled and why in auto.reason
    with pytest.raises(ValueError, match=r"`--compile on`: .*Allowed: --compile auto or off"):
        decide("on", "cpu", False, False, model)


def test_scratch_block_is_one_more_per_group_and_never_scheduled(lm):
    groups = same_blocks(lm.config.layer_windows, BLOCKS, layer_shapes(lm.config))
    pool = KVPool.for_config(lm.config, BLOCKS, BLOCK, lm.dtype, "cpu", scratch_groups(groups))
    assert [g.num_blocks for g in pool.groups] == [BLOCKS + 1] * len(groups)
    assert scheduler_shapes(pool) == tuple((g.window, BLOCKS) for g in groups)


def test_inductor_cache_sits_beside_the_architectures_triton_cache():
    env = {"TRITON_CACHE_DIR": "/c/triton/sm_89"}
    assert use_inductor_cache(env) == Path("/c/triton/sm_89-inductor")
    assert env[ENV_INDUCTOR_CACHE_DIR] == "/c/triton/sm_89-inductor"
    empty: dict = {}
    assert use_inductor_cache(empty) is None and ENV_INDUCTOR_CACHE_DIR not in empty


def test_compile_is_a_startup_step_after_the_server_is_built():
    assert STARTUP_STEPS[-2:] == ("serve", "compile")


# -- the command lines -----------------------------------------------------------------------


def test_worker_compile_flag_defaults_to_the_routers_auto_and_names_a_bad_value(monkeypatch, capsys):
    from workers.main import parse_args

    monkeypatch.delenv("HETSERVE_COMPILE", raising=False)
    assert parse_args(["--socket", "/tmp/x.sock"]).compile == AUTO  # the router leaves auto off the worker's argv
    monkeypatch.setenv("HETSERVE_COMPILE", "on")
    assert parse_args(["--socket", "/tmp/x.sock"]).compile == "on"
    for bad in (["--compile", "fast"], []):
        monkeypatch.setenv("HETSERVE_COMPILE", "fast")
        with pytest.raises(SystemExit):
            parse_args(["--socket", "/tmp/x.sock", *bad])
        assert "`--compile fast` is not a mode (or `$HETSERVE_COMPILE`). Accepted: auto, on, off" in \
            capsys.readouterr().err


def test_router_compile_flag_is_validated_and_forwarded_unless_auto():
    from server.cli import build_parser
    from server.config.settings import RouterSettings
    from server.fleet.spec import build_worker_specs

    parse = build_parser().parse_args
    with pytest.raises(UsageError, match=r"`--compile fast` is not a mode\. Accepted: auto, on, off"):
        RouterSettings.from_args(parse(["serve", "--compile", "fast"]))
    assert compile_from_args(argparse.Namespace()) == AUTO
    for mode, forwarded in (("auto", AUTO), ("on", "on"), ("off", "off")):
        settings = RouterSettings.from_args(parse(["serve", "--compile", mode]))
        (spec,) = build_worker_specs([cpu_device()], settings, Path("/tmp/run"), parent_pid=1, base_env={})
        assert spec.config.compile == forwarded
    # auto leaves the choice to `$HETSERVE_COMPILE` where the router runs, resolved into each config
    settings = RouterSettings.from_args(parse(["serve"]))
    (spec,) = build_worker_specs([cpu_device()], settings, Path("/tmp/run"), 1, base_env={"HETSERVE_COMPILE": "on"})
    assert spec.config.compile == "on"


# -- the engine, compiled against eager ------------------------------------------------------


def test_greedy_fp32_tokens_equal_eager_for_batches_of_1_3_and_5(lm, eager_tokens, compiled_engine):
    spy = StepSpy(compiled_engine.runner)
    for n in (1, 3, 5):
        assert serve(compiled_engine, lm, n) == eager_tokens[n]
    rows = [r for step in spy.steps for kind, r in step if kind == "compiled"]
    assert {1, 3, 4} <= set(rows)  # alone, three rows padded into bucket 4, a full bucket
    kinds = spy.kinds()
    assert {"compiled", "eager"} in kinds  # decodes compiled beside a prompt chunk run eager, in one step
    assert {"eager"} in kinds  # prompts alone run eager


def test_with_the_cpu_kernel_a_mixed_step_is_one_eager_forward(lm, eager_tokens):
    """Guards `ModelRunner._execute_compiled`'s `in_place` branch: where decode rows read the pool
    in place, a step mixing decodes with a prompt chunk is one eager forward (no compiled decode
    beside it); decodes alone still run compiled; greedy fp32 tokens equal eager's."""
    from kernels_local.paged_attention import cpu as cpu_decode

    if not cpu_decode.load().available:
        pytest.skip(f"no CPU decode kernel here: {cpu_decode.load().reason}")
    engine = make_engine(lm, "inductor", in_place=True)
    spy = StepSpy(engine.runner)
    assert serve(engine, lm, 5) == eager_tokens[5]
    kinds = spy.kinds()
    # the same requests split their mixed steps without the kernel (the test above): here none is split
    assert {"compiled"} in kinds and {"eager"} in kinds and {"compiled", "eager"} not in kinds


def test_pad_rows_write_only_the_scratch_block_and_rows_match_eager(lm, compiled_engine):
    decode, pool = compiled_engine.runner.compiled, compiled_engine.runner.kv
    chunks = [chunk(65, 3, [5]), chunk(66, 20, [7, 9]), chunk(67, 40, [11, 12, 13])]  # 3 rows: bucket 4
    before = [t.clone() for t in pool.tensors]
    with torch.inference_mode():
        got = decode.run(chunks)
    written = {(c.block_table[c.start_pos // BLOCK], c.start_pos % BLOCK) for c in chunks}
    scratch = decode.scratch[0]
    for t, b in zip(pool.tensors, before, strict=True):  # [L, 2, Hkv, NB, B, D]
        changed = {(int(blk), int(off)) for blk, off in (t != b).any(-1).any(2).any(1).any(0).nonzero()}
        assert changed - {(scratch, o) for o in range(BLOCK)} == written
        t.copy_(b)
    want = eager_logits(lm, pool, chunks)
    for t, b in zip(pool.tensors, before, strict=True):
        t.copy_(b)
    assert got.shape == want.shape == (3, lm.config.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_steps_outside_the_buckets_run_eager(compiled_engine):
    """Guards `fits`: more rows than the largest bucket, a multi-token or non-sampling chunk run eager."""
    decode = compiled_engine.runner.compiled
    one = chunk(65, 3, [5])
    assert decode.fits([one] * MAX_BATCH)
    assert not decode.fits([one] * (MAX_BATCH + 1))
    assert not decode.fits([])
    assert not decode.fits([SimpleNamespace(**{**vars(one), "token_ids": [65, 66]})])
    assert not decode.fits([SimpleNamespace(**{**vars(one), "samples": False})])
    assert compiled_engine.runner._execute_compiled([one] * (MAX_BATCH + 1)) is None


def test_capability_description_lists_buckets_and_seconds(compiled_engine):
    decode = compiled_engine.runner.compiled
    assert decode.ready and decode.describe()["buckets"] == [1, 2, 4] and decode.describe()["seconds"] > 0


def test_graph_replays_keep_earlier_outputs_and_match_eager(lm, eager_tokens):
    """Guards `run`'s `.clone()`: a replay overwrites the captured output of the previous one."""
    engine = make_engine(lm, "cuda-graphs")
    decode = engine.runner.compiled
    assert decode._graphs.captured == 3  # one graph per bucket
    a, b = [chunk(65, 3, [5])], [chunk(90, 17, [8, 2])]
    with torch.inference_mode():
        first = decode.run(a)
        kept = first.clone()
        decode.run(b)
    torch.testing.assert_close(first, kept)
    assert serve(engine, lm, 3) == eager_tokens[3]


def two_row_engine(lm, groups, compiled: bool) -> Engine:
    """An engine of 2 sequences over KV `groups` (each with the pads' scratch block when
    `compiled`: buckets 1 and 2, traced with aot_eager), scheduling as the worker does
    (its rotary's policy included)."""
    groups = scratch_groups(groups) if compiled else groups
    pool = KVPool.for_config(lm.config, BLOCKS, BLOCK, lm.dtype, "cpu", groups)
    shapes = scheduler_shapes(pool) if compiled else pool.group_shapes
    decode = None
    if compiled:
        decode = CompiledDecode(lm.model, pool, "cpu", (1, 2), "inductor", dynamo_backend="aot_eager")
        decode.warm()
    config = SchedulerConfig(2, lm.config.context_length, shapes[0][1], BLOCK, 2048, False,
                             eos_token_ids=(), kv_groups=shapes, rope=lm.model.rope_policy)
    return Engine(ModelRunner(lm.model, pool, "cpu", compiled=decode), Scheduler(config), lm.tokenizer, max_queue=8)


def test_a_sliding_group_with_fewer_blocks_than_the_context(tmp_path):
    """Guards `max_width` from the context: a sliding group's table outgrows the group's blocks."""
    from dataclasses import replace

    from tests.family_checkpoints import make_family_checkpoint

    gemma = load_model(make_family_checkpoint("gemma3", tmp_path / "gemma3"), "float32")

    def run(compiled: bool) -> list[list[int]]:
        groups = same_blocks(gemma.config.layer_windows, BLOCKS, layer_shapes(gemma.config))
        groups = tuple(replace(g, num_blocks=3) if g.window is not None else g for g in groups)  # 48 positions
        assert len(groups) == 2
        engine = two_row_engine(gemma, groups, compiled)
        streams = [engine.submit(gemma.tokenizer.encode(p).ids, SamplingParams.create(max_new_tokens=n))
                   for p, n in (("Hello there", 70), ("Once upon", 60))]
        while engine.step():
            pass
        return [[e.token_id for e in s.events] for s in streams]

    assert run(True) == run(False)


def test_a_longrope_model_compiles_and_decodes_as_eager_across_its_switch(tmp_path):
    """Guards the bucket's rotation lengths (`_Bucket.fill`'s `rope_lens`) and `lookup`'s
    per-token `where` under compile: Phi-3's LongRoPE compiles, and a short prompt that decodes
    past `original_max_position_embeddings` (32) and a long one past it from the start give
    eager's greedy tokens (without the lengths, every row would take the short factors)."""
    from tests.family_checkpoints import make_family_checkpoint

    phi = load_model(make_family_checkpoint("phi3", tmp_path / "phi3"), "float32")
    assert unfit_reason(phi.model) is None and phi.model.rope_threshold == 32

    def run(compiled: bool) -> tuple[list[list[int]], int]:
        engine = two_row_engine(phi, same_blocks(phi.config.layer_windows, BLOCKS, layer_shapes(phi.config)), compiled)
        spy = StepSpy(engine.runner) if compiled else None
        long_prompt = list(range(5, 45))  # 40 tokens: past the switch from its first token
        streams = [engine.submit(ids, SamplingParams.create(max_new_tokens=n, ignore_eos=True))
                   for ids, n in ((list(range(5, 15)), 36), (long_prompt, 12))]
        while engine.step():
            pass
        ran = sum(kind == "compiled" for step in spy.steps for kind, _ in step) if spy else 0
        return [[e.token_id for e in s.events] for s in streams], ran

    compiled_tokens, compiled_steps = run(True)
    assert compiled_steps > 20  # the decodes ran compiled, before the switch and after it
    assert compiled_tokens == run(False)[0]


@pytest.mark.parametrize("arch, kernelized", [("qwen3_moe", False), ("gpt_oss", True), ("mixtral", "packed")])
def test_an_moe_model_compiles_and_decodes_as_eager(tmp_path, arch, kernelized):
    """Guards the experts' opaque op inside the graph (the model's `hetserve::grouped_experts`,
    and the CPU kernel layer's `hetserve_fused_moe::grouped_experts` once kernelized as a CPU
    worker is; `packed`: and its projections through `hetserve::packed_linear`, the experts'
    packs in prompt steps) and `unfit_reason`'s MoE clause: the decode steps run compiled and give
    eager's greedy tokens (gpt-oss: sinks, biases, the clamped SwiGLU, sliding layers shorter
    than the prompt)."""
    from tests.family_checkpoints import make_family_checkpoint
    from workers.device.bind import BoundDevice
    from workers.kernelize.apply import kernelize_for_device
    from workers.model.cpu_projections import install_cpu_projections

    lm = load_model(make_family_checkpoint(arch, tmp_path / arch), "float32")
    if kernelized:
        kernelize_for_device(lm.model, BoundDevice("cpu", 0, "cpu", "cpu", None, 0, False))
    if kernelized == "packed":  # every matrix packed, however small, as a worker packs a real model's
        assert install_cpu_projections(lm.model, "cpu", lm.dtype, min_elements=0).packed > 0
    assert lm.config.sparse_layers and unfit_reason(lm.model) is None
    assert decide("auto", "cpu", False, False, lm.model).enabled

    def run(compiled: bool) -> tuple[list[list[int]], int]:
        engine = two_row_engine(lm, same_blocks(lm.config.layer_windows, BLOCKS, layer_shapes(lm.config)), compiled)
        spy = StepSpy(engine.runner) if compiled else None
        streams = [engine.submit(ids, SamplingParams.create(max_new_tokens=n, ignore_eos=True))
                   for ids, n in ((list(range(5, 25)), 24), (list(range(30, 36)), 16))]
        while engine.step():
            pass
        ran = sum(kind == "compiled" for step in spy.steps for kind, _ in step) if spy else 0
        return [[e.token_id for e in s.events] for s in streams], ran

    compiled_tokens, compiled_steps = run(True)
    assert compiled_steps > 20
    assert compiled_tokens == run(False)[0]


class _QuantizedExperts(torch.nn.Module):
    kernel_layer_name = "Fp8FusedMoE"


def test_moe_experts_stay_eager_in_a_gpu_graph_and_when_quantized():
    """Guards the MoE clause's two refusals: a CUDA/HIP graph does not capture the experts yet,
    and a pre-quantized checkpoint's experts loop over experts on the host."""
    model = torch.nn.Module()
    model.step, model.config = None, SimpleNamespace(sparse_layers=(1,))
    assert unfit_reason(model) is None
    gpu = decide("auto", "cuda", False, False, model)
    assert not gpu.enabled and "MoE layers" in gpu.reason and "graph" in gpu.reason
    model.experts = _QuantizedExperts()
    assert "quantized experts (Fp8FusedMoE)" in unfit_reason(model)
    with pytest.raises(ValueError, match=r"`--compile on`: its quantized experts \(Fp8FusedMoE\)"):
        decide("on", "cpu", False, False, model)


class FailingGraphs:
    def capture(self, fn):
        raise RuntimeError("capture failed: out of graph memory")


def test_a_failed_compile_serves_eager_under_auto_and_fails_the_start_under_on(lm):
    """Guards `warm_or_eager`: `auto` logs and goes eager, `on` raises (the start fails at `compile`)."""
    groups = scratch_groups(same_blocks(lm.config.layer_windows, 4, layer_shapes(lm.config)))
    pool = KVPool.for_config(lm.config, 4, BLOCK, lm.dtype, "cpu", groups)
    decode = CompiledDecode(lm.model, pool, "cpu", (1,), "cuda-graphs", graphs=FailingGraphs())
    auto = decide("auto", "cuda", False, False, lm.model)
    after = warm_or_eager(auto, decode)
    assert not after.enabled and after.backend is None and after.mode == "auto"
    assert after.reason.startswith("auto, compiling failed (RuntimeError: capture failed: out of graph memory)")
    with pytest.raises(RuntimeError, match="capture failed"):
        warm_or_eager(decide("on", "cuda", False, False, lm.model), decode)


def test_a_wrong_backend_is_named():
    with pytest.raises(ValueError, match=r"Unknown compile backend `xla`\. Allowed: inductor, cuda-graphs"):
        CompiledDecode(None, SimpleNamespace(groups=()), "cpu", (1,), "xla")


def test_auto_compiles_behind_steps_that_run_eager_meanwhile():
    """Guards `if self.background:` in `BuiltEngine.compile` (workers/engine/build.py): under
    `--compile auto` a CPU worker's compile starts on its own thread and `compile()` returns at
    once; steps run eager with the same tokens meanwhile, and the compiled decode once it is
    ready. Without the branch `compile()` would warm first and `seen` would never be "compiling".
    The steps wait while a bucket compiles (`Engine.steps_held`): run beside it, with the
    compile's warm caches of the module's earlier tests, the eager tokens came out different."""
    from workers.engine.build import BuiltEngine

    lm = load_model(default_model_dir(), "float32")
    eager_tokens = {3: serve(make_engine(lm, None), lm, 3)}
    engine = make_engine(lm, "inductor", warm=False)
    decode = engine.runner.compiled
    built = BuiltEngine(engine, decode.kv, CompileDecision("auto", True, "inductor", "auto, a CPU worker"), decode)
    changes = []
    said = built.compile(on_change=lambda: changes.append(decode.state))
    seen = decode.state
    assert "compiling in the background" in said and seen in ("compiling", "ready")
    assert serve(engine, lm, 3) == eager_tokens[3]  # whatever the compile's progress
    built.behind.join(timeout=300)
    assert decode.ready and changes[-1] == "ready" and set(changes[:-1]) <= {"compiling"} and built.decision.enabled
    spy = StepSpy(engine.runner)
    assert serve(engine, lm, 3) == eager_tokens[3]
    assert {"compiled"} in spy.kinds()


def test_a_background_compile_that_fails_leaves_the_worker_eager(lm, eager_tokens):
    """Under `auto` a failed background compile is logged and every step stays eager: the
    runner keeps the failed compile, which is never run (`ready` is False)."""
    from workers.engine.build import BuiltEngine

    engine = make_engine(lm, "inductor", warm=False, dynamo_backend="no-such-backend")
    decode = engine.runner.compiled
    built = BuiltEngine(engine, decode.kv, CompileDecision("auto", True, "inductor", "auto, a CPU worker"), decode)
    built.compile()
    built.behind.join(timeout=300)
    assert decode.state == "failed" and not decode.ready
    assert not built.decision.enabled and "compiling failed" in built.decision.reason and built.compiled is None
    assert serve(engine, lm, 3) == eager_tokens[3]


# -- real Inductor, real workers (slow) ------------------------------------------------------


@pytest.mark.slow
def test_inductor_tokens_equal_eager_on_a_small_checkpoint(tmp_path):
    from tests.checkpoints import make_checkpoint

    small = load_model(make_checkpoint(tmp_path / "m"), "float32")
    eager = make_engine(small, None)
    compiled = make_engine(small, "inductor", buckets=(MAX_BATCH,), dynamo_backend="inductor")
    spy = StepSpy(compiled.runner)
    assert serve(compiled, small, 5) == serve(eager, small, 5)
    assert {"compiled", "eager"} in spy.kinds()


def _worker_compile(tmp: Path, model: Path, *flags: str):
    from tests.test_worker_process import start_worker

    tmp.mkdir()
    return start_worker(tmp, model, "--max-batch", "1", *flags)


@pytest.mark.slow
def test_workers_with_compile_on_off_and_deterministic(tmp_path):
    from tests.checkpoints import make_checkpoint
    from tests.test_worker_process import client, wait_state

    model = make_checkpoint(tmp_path / "m")
    workers = {name: _worker_compile(tmp_path / name, model, *flags) for name, flags in (
        ("on", ("--compile", "on")), ("off", ("--compile", "off")),
        ("deterministic", ("--compile", "on", "--deterministic")))}
    try:
        for proc, _, status in workers.values():
            wait_state(proc, status, {"ready"}, timeout=400)
        caps, texts = {}, {}
        for name, (_, sock, _) in workers.items():
            with client(sock) as c:
                caps[name] = c.get("/capability").json()["compile"]
                body = {"inputs": "Hello there", "parameters": {"max_new_tokens": 16, "details": True}}
                texts[name] = [t["id"] for t in c.post("/generate", json=body).json()["details"]["tokens"]]
        on = caps["on"]
        assert (on["enabled"], on["backend"], on["buckets"]) == (True, "inductor", [1]) and on["seconds"] > 0
        assert caps["off"]["enabled"] is False and caps["off"]["buckets"] == []
        assert caps["deterministic"]["enabled"] is False and "deterministic" in caps["deterministic"]["reason"]
        assert texts["on"] == texts["off"] and len(texts["on"]) > 1
        log = workers["on"][0].log_path.read_text()
        assert re.search(r"step compile done in \d+\.\d+s", log)
    finally:
        for proc, _, _ in workers.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
