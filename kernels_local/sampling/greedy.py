"""Greedy rows' torch reference: each row's most likely token under log_softmax and its logprob.

The sampler's own form is workers/sampling/sampler.py `sample_tokens` (log_softmax, argmax,
gather); this copy is the reference the repository's CPU kernel (cpu.py) and its layers fall back
to, since a kernel repository imports no worker code (tests/test_kernels_repos.py holds the two
equal).
"""

from __future__ import annotations

import torch


def greedy_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`log_softmax(logits [N, V]).argmax(-1)` and those logprobs: (ids [N] int64, logprobs [N])."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [N, V]
    ids = logprobs.argmax(dim=-1)  # [N]
    return ids, logprobs.gather(1, ids[:, None])[:, 0]
