"""A circuit breaker per worker: stop sending requests to a worker that keeps failing them.

Design: the breaker sees only request outcomes; the supervisor's health checks (hangs, crashes)
are separate and take a worker out of rotation whatever its breaker says. A 429 (queue full)
says nothing about the worker's health and counts neither way. Trade-off: a breaker opens on
request outcomes, so a worker that fails only some prompts (say, one that always crashes it) can
be opened by one client's bad luck; the cool-down is short and one good probe closes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


class BreakerState(StrEnum):
    """`/workers` `breaker.state`:
    - `closed`: requests flow; consecutive failures (connection errors, 5xx answers, streams lost
      mid-way) are counted and any success resets the count;
    - `open`: after `failures` consecutive failures the worker gets no request for `cooldown_s`
      seconds, while the others serve;
    - `half_open`: once the cool-down is over, exactly one request goes through as a probe: its
      success closes the breaker, its failure opens it again for another cool-down."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerPolicy:
    failures: int = 5  # consecutive failures that open the breaker
    cooldown_s: float = 10.0  # how long it stays open before one probe request

    def __post_init__(self) -> None:
        if self.failures < 1:
            raise ValueError(f"breaker failures must be >= 1, got `{self.failures}`")
        if self.cooldown_s < 0:
            raise ValueError(f"breaker cool-down must be >= 0 seconds, got `{self.cooldown_s}`")


class CircuitBreaker:
    """One worker's breaker. Lives on the router's event loop (no locks)."""

    def __init__(self, policy: BreakerPolicy, clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self._clock = clock
        self.reset()
        self.times_opened = 0

    def reset(self) -> None:
        """Closed, no failures: a new worker process starts with a clean record."""
        self._state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.last_failure: str | None = None
        self._opened_at = 0.0
        self._probe_out = False

    @property
    def state(self) -> BreakerState:
        if self._state == BreakerState.OPEN and self._clock() - self._opened_at >= self.policy.cooldown_s:
            self._state = BreakerState.HALF_OPEN  # the cool-down is over: one probe may go
        return self._state

    def admits(self) -> bool:
        """Whether a request may be sent there now (in `half_open`: only while no probe is out)."""
        state = self.state
        return state == BreakerState.CLOSED or (state == BreakerState.HALF_OPEN and not self._probe_out)

    def on_dispatch(self) -> None:
        """A request was sent there; in `half_open` it is the probe."""
        if self.state == BreakerState.HALF_OPEN:
            self._probe_out = True

    def on_success(self) -> None:
        self.reset()

    def on_failure(self, why: str) -> None:
        self.last_failure = why
        self.consecutive_failures += 1
        state = self.state
        if state == BreakerState.HALF_OPEN or (state == BreakerState.CLOSED
                                               and self.consecutive_failures >= self.policy.failures):
            self._state, self._opened_at, self._probe_out = BreakerState.OPEN, self._clock(), False
            self.times_opened += 1

    def on_neutral(self) -> None:
        """A request ended with no verdict on the worker (429, the client left): the probe slot is free again."""
        self._probe_out = False

    def retry_in_s(self) -> float:
        """Seconds until an open breaker lets a probe through (0 when not open)."""
        if self.state != BreakerState.OPEN:
            return 0.0
        return max(0.0, self.policy.cooldown_s - (self._clock() - self._opened_at))

    def snapshot(self) -> dict:
        """`/workers` `breaker`: `last_failure` once there is one, `retry_in_s` while open."""
        out: dict = {"state": str(self.state), "consecutive_failures": self.consecutive_failures,
                     "times_opened": self.times_opened}
        if self.last_failure is not None:
            out["last_failure"] = self.last_failure
        if out["state"] == BreakerState.OPEN:
            out["retry_in_s"] = round(self.retry_in_s(), 1)
        return out
