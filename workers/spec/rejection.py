"""Verification of a deterministic draft against the target model's distribution.

Design: Leviathan et al.'s rule accepts a draft token `d` with probability min(1, p(d) / q(d));
an n-gram draft is deterministic (q(d) = 1), so `d` is accepted with probability p(d), and on
rejection the next token is drawn from the residual max(p - q, 0), that is p without `d`,
renormalised. We realise the rule with the request's own generator and ONE uniform per emitted
token: the target token at position j is the inverse-CDF draw of p_j at the uniform plain sampling
would have used for that token (workers/sampling/sampler.py), and `d` is accepted when that draw
is `d` (probability p(d)); a draw other than `d` is distributed as the residual. Greedy rows take
the argmax and accept while it equals the draft. Every emitted token is therefore the token plain
decoding would have emitted from the same logits and the same uniform: a seed reproduces whatever
k each step chose, the batch it ran in, or a migration (which skips one draw per token sent).
Trade-off: the verification walks positions one by one in Python (a handful per row) rather than
one batched op, since the number of uniforms drawn must depend on where the first rejection is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_greedy(target_ids: Sequence[int], drafts: Sequence[int]) -> int:
    """How many leading drafts equal the target's argmax at their position (`target_ids`: k+1
    argmax tokens, one per position); the emitted tokens are `target_ids[: accepted + 1]`."""
    accepted = 0
    for target, draft in zip(target_ids, drafts, strict=False):
        if target != draft:
            break
        accepted += 1
    return accepted


def draw(logprobs: torch.Tensor, u: float) -> int:
    """The inverse-CDF draw of one row of `logprobs` [V] at the uniform `u` (the sampler's rule)."""
    cdf = logprobs.exp().cumsum(dim=-1)  # [V]
    index = torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True).clamp_(max=cdf.shape[-1] - 1)
    return int(index[0])


def accept_sampled(logprobs: torch.Tensor, drafts: Sequence[int], generator: torch.Generator | None
                   ) -> list[int]:
    """The tokens a sampled row emits: accepted drafts, then the corrected or bonus token
    (`logprobs` [k+1, V]: the target's processed log-probabilities at each position; one uniform
    from `generator` per emitted token). Always at least one token."""
    emitted: list[int] = []
    for j in range(logprobs.shape[0]):
        u = torch.rand(1, generator=generator)
        token = draw(logprobs[j], u)
        emitted.append(token)
        if j >= len(drafts) or token != drafts[j]:
            break
    return emitted
