"""N-gram drafts: the tokens that followed the last earlier occurrence of the sequence's tail.

Design (vLLM's n-gram proposer): the last `n` tokens of a sequence's prompt + output are looked up
earlier in the same tokens, `n` from `max_n` down to `min_n`; at the latest match, the up to `k`
tokens that followed it are the draft. Code edits, quotes and repeated structure hit often; prose
rarely, and then nothing is proposed (no draft costs no verification). Trade-off: a reverse scan
over the sequence's tokens per step (candidate positions found by the tail's last token first)
instead of an index kept per sequence: no memory and no invalidation, at a cost linear in the
sequence's length, which is small beside a forward for the lengths a CPU worker serves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_MIN_N = 1
DEFAULT_MAX_N = 4


@dataclass(frozen=True)
class NgramProposer:
    """Proposes up to `k` tokens by n-gram lookup (`min_n <= n <= max_n`)."""

    min_n: int = DEFAULT_MIN_N
    max_n: int = DEFAULT_MAX_N

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram sizes `{self.min_n}..{self.max_n}` are not accepted. "
                             f"Accepted: 1 <= min_n <= max_n")

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` draft tokens continuing `tokens` (empty: no match, or `k` < 1)."""
        size = len(tokens)
        if k < 1 or size < 2:
            return []
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            start = _latest_match(tokens, n)
            if start is not None:
                return list(tokens[start + n : start + n + k])
        return []


def _latest_match(tokens: Sequence[int], n: int) -> int | None:
    """The start of the latest occurrence of the last `n` tokens before the tail itself, with at
    least one token after it; None when there is none."""
    size = len(tokens)
    tail = list(tokens[size - n :])
    last = tail[-1]
    # candidate ends: positions i < size - 1 holding the tail's last token, latest first
    for end in range(size - 2, n - 2, -1):
        if tokens[end] == last and list(tokens[end - n + 1 : end + 1]) == tail:
            return end - n + 1
    return None
