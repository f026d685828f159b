"""The compiled decode's guards (workers/engine/compiled.py `own_code`, `skip_model_state_guards`):
Dynamo checks a step's inputs, the KV pool and the model's plain attributes on every call, not the
model's submodules and weights (fixed once a worker has built its model), and each decode looks
up its graphs among its own entries only, so two models in one process never share a graph.

Traced with `aot_eager`, as tests/test_compiled_step.py does (the same guards as Inductor's).
"""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import default_model_dir
from tests.test_compiled_step import BLOCK, BLOCKS, chunk, eager_logits
from workers.engine import compiled as compiled_mod
from workers.engine.compiled import MODEL_STATE, CompiledDecode, scratch_groups
from workers.kv.groups import same_blocks
from workers.kv.pool import KVPool, layer_shapes
from workers.model.layers import GeluTanhAndMul, SiluAndMul
from workers.model.loader import load_model


def compiled_decode(lm) -> tuple[CompiledDecode, KVPool]:
    """A warmed one-row decode of `lm` over its own pool (aot_eager)."""
    groups = scratch_groups(same_blocks(lm.config.layer_windows, BLOCKS, layer_shapes(lm.config)))
    pool = KVPool.for_config(lm.config, BLOCKS, BLOCK, lm.dtype, "cpu", groups)
    decode = CompiledDecode(lm.model, pool, "cpu", (1,), "inductor", dynamo_backend="aot_eager")
    decode.warm()
    return decode, pool


@pytest.fixture(scope="module")
def pair():
    """The embedded model twice, the second with gelu-tanh for silu in every MLP: the same shapes,
    the same KV pool, the same config, so only guards on the model's submodules tell them apart."""
    torch.set_num_threads(1)
    first, second = load_model(default_model_dir(), "float32"), load_model(default_model_dir(), "float32")
    swapped = 0
    for module in second.model.modules():
        if isinstance(getattr(module, "act", None), SiluAndMul):
            module.act = GeluTanhAndMul()
            swapped += 1
    assert swapped == second.config.num_hidden_layers
    return first, second


def test_two_models_of_one_shape_each_run_their_own_graph(pair):
    """Guards `own_code` (each decode's step over its own code object): without it the second
    model's first call matches the first model's graph, whose guards no longer look at the
    submodules, and returns silu's logits for the gelu model."""
    first, second = pair
    runs = [(lm, *compiled_decode(lm)) for lm in (first, second)]
    one = [chunk(65, 0, [3])]
    got = []
    for lm, decode, pool in runs:
        with torch.inference_mode():
            logits = decode.run(one)
        want = eager_logits(lm, pool, one)  # the same position again: the same K/V written
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
        got.append(logits)
    assert (got[0] - got[1]).abs().max() > 1e-2  # the two models differ where it shows


def test_the_model_state_guards_are_dropped_and_the_inputs_kept(pair, monkeypatch):
    """Guards the `guard_filter_fn` passed to `torch.compile`: the filter sees the step's guards,
    drops every one on the model's submodules (most of them) and keeps those on the batch and
    the KV pool; without the option it is never called."""
    seen: list[tuple[str, bool]] = []
    real = compiled_mod.skip_model_state_guards

    def spy(entries):
        keep = real(entries)
        seen.extend((e.name, k) for e, k in zip(entries, keep, strict=True))
        return keep

    monkeypatch.setattr(compiled_mod, "skip_model_state_guards", spy)
    compiled_decode(pair[0])
    assert seen, "torch.compile was not given the guard filter"
    dropped = [name for name, keep in seen if not keep]
    kept = [name for name, keep in seen if keep]
    assert all(name.startswith(MODEL_STATE) for name in dropped)
    assert not any(name.startswith(MODEL_STATE) for name in kept)
    assert len(dropped) > len(kept)
    assert any(name.startswith("batch") for name in kept) and any(name.startswith("kv") for name in kept)
