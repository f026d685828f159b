"""Rolling a linear-attention layer's state back to the last accepted draft token.

A drafted decode row (workers/engine/speculate.py) runs its last token and k drafts as one chunk,
and every Gated DeltaNet layer (workers/model/linear_attention.py) steps its conv and recurrent
state over all k+1 tokens, in place, whatever the rule's kernel. When drafts are rejected, the
state must be the one after the accepted tokens only. Design: while such a step runs, the pool
carries a `StateRollback` (`StatePool.recorder`); each layer hands it, for the drafted rows'
slots, the state before the step (a copy) and the step's own inputs to the rule (mixed conv
inputs, q, k, v, g, beta: copies of the drafted rows only). `rollback` then rebuilds a slot's
state from those: the conv state is the last `K - 1` of the saved inputs up to the accepted one,
and the recurrent state replays the accepted tokens token by token (`recurrent_delta_rule`, the
form deterministic mode and the decode rows use, so in deterministic mode the state has exactly
the bits plain decoding gives it). Trade-off: one copy of each drafted row's state per layer and
step, and a replay of at most k+1 tokens on rejection, instead of a state per position kept by
every kernel (vLLM's and SGLang's way): any rule kernel works unchanged.
"""

from __future__ import annotations

import torch

from workers.model.linear_attention import recurrent_delta_rule


class StateRollback:
    """The drafted rows' pre-step state and rule inputs of one step, per layer and slot."""

    def __init__(self, slots) -> None:
        self.slots = frozenset(slots)  # the drafted rows' state slots
        self._saved: dict[tuple[int, int], list] = {}  # (layer, slot) -> [conv, recurrent, rows, inputs]
        self._spans: list[tuple[int, int, int]] = []

    def snapshot(self, layer: int, batch, conv_state: torch.Tensor, recurrent: torch.Tensor) -> bool:
        """Before layer `layer` steps: copy the drafted spans' states; False when the step has none."""
        self._spans = [(span.row_start, span.num_tokens, slot)
                       for span, slot in zip(batch.prefills, batch.states.prefill_slots, strict=True)
                       if slot in self.slots]
        for start, n, slot in self._spans:
            self._saved[(layer, slot)] = [conv_state[slot].clone(), recurrent[slot].clone(), slice(start, start + n)]
        return bool(self._spans)

    def inputs(self, layer: int, mixed, q, k, v, g, beta) -> None:
        """The layer's rule inputs for this step's packed tokens (after `snapshot` said True)."""
        for _, _, slot in self._spans:
            saved = self._saved[(layer, slot)]
            rows = saved[2]
            saved.append(tuple(t[rows].clone() for t in (mixed, q, k, v, g, beta)))  # not the whole step's

    def rollback(self, states, slot: int, kept: int) -> None:
        """Slot `slot`'s state in every linear layer of `states` (a `StatePool`) as after the first
        `kept` tokens of its drafted chunk (its last token and the accepted drafts)."""
        for layer in states.layers:
            saved = self._saved.get((layer, slot))
            if saved is None or len(saved) < 4:
                continue
            conv0, rec0, _, (mixed, q, k, v, g, beta) = saved
            if kept >= mixed.shape[0]:
                continue  # every draft accepted: the step left the right state
            conv, recurrent = states.layer(layer)
            width = conv0.shape[-1]
            window = torch.cat((conv0, mixed[:kept].transpose(0, 1)), dim=-1)  # [C, K-1+kept]
            conv[slot] = window[:, window.shape[-1] - width:]
            _, state = recurrent_delta_rule(q[None, :kept], k[None, :kept], v[None, :kept], g[None, :kept],
                                            beta[None, :kept], rec0[None])
            recurrent[slot] = state[0]
