"""The KV cache a worker serves from: its budget on this device, split between the layers' groups.

Design: one function sizes and allocates the paged cache for a whole model or one pipeline
stage's layers: the budget comes from this device only (workers/kv/sizing.py), the linear
layers' state (and a whole model's snapshots of it: workers/kv/snapshots.py) is taken from it
first, and the groups of layers that attend alike share the rest (workers/kv/groups.py). A stage
keeps every group, holding only its own layers, so the scheduler's block tables mean the same
blocks on every stage. Trade-off: the stages agree before allocating (`agree`: per group, the
fewest blocks any stage holds), so the stage with the least room sets every stage's blocks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from workers.contract import WorkerConfig
from workers.kv.groups import KVGroup, plan_groups
from workers.kv.pool import KVPool, layer_shapes
from workers.kv.sizing import kv_budget, plan_kv_blocks
from workers.kv.snapshots import PER_SEQUENCE, plan_snapshots
from workers.kv.state import StatePool, plan_state


def build_kv_cache(config: WorkerConfig, bound, loaded, context: int, compile_enabled: bool,
                   stage: tuple[int, int] | None = None,
                   agree: Callable[[list[int]], list[int]] | None = None) -> tuple[KVPool, str, int, str]:
    """(pool, shape description, budget, why) for this worker, or for its pipeline `stage` [start, end)."""
    cfg, dtype, bs = loaded.config, loaded.dtype, config.kv_block_size
    if stage is not None:  # a stage keeps the state of its own linear layers only
        cfg = StageShape(cfg, stage)
    per_layer = list(KVPool.block_bytes_per_layer(cfg, dtype, bs))
    if stage is not None:
        per_layer = [b if stage[0] <= i < stage[1] else 0 for i, b in enumerate(per_layer)]  # held elsewhere
    per_token = KVPool.bytes_per_token(cfg, dtype) if stage is None else max(1, sum(per_layer) // bs)
    per_state = StatePool.bytes_per_sequence(cfg, dtype) if cfg.state_layers else 0
    # a hybrid's prefix cache keeps snapshots of its state in spare slots (workers/kv/snapshots.py):
    # a whole model's worker whose attention layers form one full group, unless the cache is off
    snapshots = (per_state and stage is None and not config.no_prefix_cache
                 and all(w is None for w in cfg.layer_windows))
    weights = sum(t.numel() * t.element_size() for t in (*loaded.model.parameters(), *loaded.model.buffers()))
    budget, why = kv_budget(config, bound, per_token, context, per_state * (1 + PER_SEQUENCE * bool(snapshots)),
                            weights)
    # the linear layers' state of --max-batch sequences comes out of the budget first (workers/kv/state.py)
    state_bytes, state_why = plan_state(cfg, dtype, config.max_batch, budget)
    spare = plan_snapshots(per_state, config.max_batch, budget - state_bytes) if snapshots else 0
    budget -= state_bytes + spare * per_state
    _, shape = plan_kv_blocks(per_token, bs, budget, context)  # raises below one block
    # sliding layers get a window per sequence, the full layers the rest, each group in its own
    # shape's bytes; layers reading another's KV hold none (workers/kv/groups.py)
    groups = plan_groups(cfg.layer_windows, per_layer, budget, bs, config.max_batch, config.max_num_batched_tokens,
                         layer_shapes(cfg))
    if agree is not None:  # every stage of a pipeline: the fewest blocks any stage holds, per group
        groups = tuple(replace(g, num_blocks=n) for g, n in zip(groups, agree([g.num_blocks for g in groups]),
                                                                  strict=True))
    if compile_enabled:  # one scratch block per group for the pad rows of a bucket
        from workers.engine.compiled import scratch_groups

        groups = scratch_groups(groups)
    if stage is not None:
        shape = f"layers {stage[0]}:{stage[1]} of a pipeline, {groups[0].num_blocks} blocks x {bs} tokens"
        groups = _stage_only(groups, stage)
    kv = KVPool.for_config(cfg, groups[0].num_blocks, bs, dtype, bound.torch_device, groups,
                           state_slots=config.max_batch + spare)
    if stage is None and (len(groups) > 1 or groups[0].window is not None):
        shape = "; ".join(f"{'full' if g.window is None else f'window {g.window}'}: {len(g.layers)} layers x "
                          f"{g.num_blocks} blocks x {bs} tokens ({g.kv_heads or cfg.num_key_value_heads} KV "
                          f"heads of {g.head_dim or cfg.head_dim})" for g in groups)
    if state_bytes:
        shape += f"; linear layers' state {state_bytes} bytes: {state_why}"
        shape += (f"; {spare} slots for snapshots of it at block boundaries ({spare * per_state} bytes)" if spare
                  else "; no slots for snapshots of it: the prefix cache is off")
    return kv, shape, budget, why


class StageShape:
    """A model's config as one pipeline stage holds it: only its own linear layers keep state
    (`state_layers`); everything else is the model's."""

    def __init__(self, config, stage: tuple[int, int]):
        self._config = config
        self.state_layers = tuple(i for i in config.state_layers if stage[0] <= i < stage[1])

    def __getattr__(self, name: str):
        return getattr(self._config, name)


def _stage_only(groups: tuple[KVGroup, ...], stage: tuple[int, int]) -> tuple[KVGroup, ...]:
    return tuple(replace(g, layers=tuple(i for i in g.layers if stage[0] <= i < stage[1])) for g in groups)
