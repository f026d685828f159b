"""Each worker's measured speed: what a prompt token, an engine step and a sequence in a
step cost it, in engine-seconds.

Unequal GPUs are the point of this server, so the router learns, per worker, a linear model of
its engine step time, y = c*S + a*P + b*G over each sampling interval (`SpeedFit`), and predicts
a worker's pace at the batch it would have rather than at the batch it had: prefill tokens/s =
1/a, and a sequence decodes at 1/(c + b*B) tokens/s in a batch of B. Trade-off: a linear model
of a batched engine: attention's growth with context length and a GPU's flat step time up to its
compute bound are folded into c and b as the recent traffic saw them. A worker with no interval
yet has no estimate; the policy gives it the fleet's median. Counting the load in the model (the
B in c + b*B) instead of in the speed keeps a busy worker from looking faster (bigger batches)
and so drawing ever more traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_DECAY = 0.85  # weight kept per interval: a half-life of about 4 intervals (8 s at 2 s)
MIN_BUSY_S = 0.02  # intervals with less engine time are skipped
DAMPING = 0.05  # pull toward the previous estimate, relative to the data's own weight
REFERENCE_BATCH = 8  # the batch at which workers' decode speeds are compared
_FLOOR_S = 1e-9


@dataclass(frozen=True)
class Speed:
    """A worker's step-time model (seconds) and how many intervals it rests on."""

    step_s: float  # c: fixed cost of one engine step
    prefill_s: float  # a: per prompt token computed
    sequence_s: float  # b: per sequence decoding in a step
    samples: int = 0

    def step_time(self, batch: float) -> float:
        """Seconds of one decode step with `batch` sequences."""
        return self.step_s + self.sequence_s * max(1.0, batch)

    @property
    def prefill_tps(self) -> float:
        return 1.0 / self.prefill_s

    def decode_tps(self, batch: float = 1.0) -> float:
        """Tokens per second of the whole batch (`batch` / step time)."""
        return max(1.0, batch) / self.step_time(batch)

    @property
    def token_s(self) -> float:
        """Seconds per generated token at the reference batch: how workers' speeds compare."""
        return self.step_time(REFERENCE_BATCH) / REFERENCE_BATCH


def _first_guess(x: np.ndarray, busy_s: float) -> np.ndarray:
    """The first interval's time split evenly over the kinds of work in it; a prompt token
    costs what a sequence in a step costs until the two have been seen apart."""
    share = busy_s / int((x > 0).sum())
    theta = np.where(x > 0, share / np.where(x > 0, x, 1.0), 0.0)
    if x[1] <= 0 or x[2] <= 0:
        theta[1] = theta[2] = max(theta[1], theta[2])
    return np.maximum(theta, _FLOOR_S)


class SpeedFit:
    """One worker's decayed, damped least-squares fit of engine seconds.

    Every few seconds (the status page's sampling of the workers' `/metrics`) a worker
    contributes one interval: the engine steps it ran (S), the prompt tokens it computed (P), the
    tokens it generated (G, one per sequence per step) and the seconds its engine spent in steps
    (y). The fit is

        y = c*S + a*P + b*G        c: fixed cost of a step, a: per prompt token, b: per sequence per step

    by least squares over recent intervals (exponentially forgotten, `decay` per interval), damped
    toward the previous estimate (Levenberg-Marquardt style), so a direction the recent intervals
    cannot tell apart (say, the batch never changed, so steps and generated tokens came in one
    proportion) keeps its last value while the others follow the data."""

    def __init__(self, decay: float = DEFAULT_DECAY):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"speed decay must be in (0, 1], got `{decay}`")
        self.decay = decay
        self.samples = 0
        self._m = np.zeros((3, 3))  # sum of w * x x^T, x = (S, P, G)
        self._v = np.zeros(3)  # sum of w * x y
        self._theta: np.ndarray | None = None  # (c, a, b)
        self._estimate: Speed | None = None  # of `_theta`, made once per new fit: routing asks per request

    def observe(self, steps: float, prompt_tokens: float, generated_tokens: float, busy_s: float) -> None:
        """One interval's work and engine time (skipped when the engine was nearly idle)."""
        x = np.array([steps, prompt_tokens, generated_tokens], dtype=float)
        if busy_s < MIN_BUSY_S or steps <= 0 or (x < 0).any():
            return
        self._m = self.decay * self._m + np.outer(x, x)
        self._v = self.decay * self._v + x * busy_s
        self.samples += 1
        if self._theta is None:
            self._theta = _first_guess(x, busy_s)
        self._theta = self._solve(self._theta)
        self._estimate = None

    def _solve(self, prior: np.ndarray) -> np.ndarray:
        damping = DAMPING * np.diag(np.maximum(np.diag(self._m), 1.0))
        theta = np.linalg.solve(self._m + damping, self._v + damping @ prior)
        return np.maximum(theta, _FLOOR_S)

    def estimate(self) -> Speed | None:
        if self._theta is None:
            return None
        if self._estimate is None:
            c, a, b = (float(v) for v in self._theta)
            self._estimate = Speed(step_s=c, prefill_s=a, sequence_s=b, samples=self.samples)
        return self._estimate
