"""The prompt tokens an engine computes, summed over its steps (tests and benchmarks of prefix reuse)."""

from __future__ import annotations


def count_prefill(side) -> None:
    """From now on `side.prefill` sums the prompt tokens `side.engine` computes: its scheduler's
    `schedule` wrapped, each step's `num_prefill_tokens` added."""
    side.prefill = 0
    schedule = side.engine.scheduler.schedule

    def counting(*a, **k):
        out = schedule(*a, **k)
        side.prefill += out.num_prefill_tokens
        return out

    side.engine.scheduler.schedule = counting
