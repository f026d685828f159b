"""Each worker's measured speed: prefill and decode tokens per second of engine time.

Unequal GPUs are the point of this server, so the router does not assume them equal: it
learns, per worker, how many engine-seconds a prompt token and a generated token cost. Every
few seconds (the status page's sampling of the workers' `/metrics`) each worker contributes
one interval: the prompt tokens it computed (P), the tokens it generated (G) and the
seconds its engine spent in steps (y). The estimate is a least-squares fit of y = a*P + b*G
over recent intervals (exponentially forgotten, `decay` per interval); prefill speed is 1/a,
decode speed 1/b. Intervals with almost no engine time say nothing and are skipped.

When the recent intervals cannot tell prompt work from generation apart (they always came
in the same proportion, or only one kind came), the fit keeps the last ratio a/b that it
could tell (else `PRIOR_PREFILL_TO_DECODE`) and fits only the scale. A worker with no
interval yet has no estimate; the policy then gives it the fleet's median.

Trade-off: a linear model of a batched engine. Decode cost per token falls as the batch
grows (one step serves the whole batch), so `b` is the cost at the recent batch sizes and
follows the load with a lag of a few intervals; it is a speed for comparing workers and
predicting backlog, not a latency guarantee.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_PREFILL_TO_DECODE = 0.1  # a prompt token costs a tenth of a generated one until measured
DEFAULT_DECAY = 0.85  # weight kept per interval: a half-life of about 4 intervals (8 s at 2 s)
MIN_BUSY_S = 0.02  # intervals with less engine time are skipped
_ILL_CONDITIONED = 0.05  # 1 - correlation^2 of (P, G) below this: the two cannot be told apart


@dataclass(frozen=True)
class Speed:
    """Tokens per engine-second, and how many intervals the estimate rests on."""

    prefill_tps: float
    decode_tps: float
    samples: int

    @property
    def prefill_s(self) -> float:
        return 1.0 / self.prefill_tps

    @property
    def decode_s(self) -> float:
        return 1.0 / self.decode_tps


class SpeedFit:
    """One worker's decayed least-squares fit of engine seconds on (prompt, generated) tokens."""

    def __init__(self, decay: float = DEFAULT_DECAY, prior_ratio: float = PRIOR_PREFILL_TO_DECODE):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"speed decay must be in (0, 1], got `{decay}`")
        self.decay = decay
        self.ratio = prior_ratio  # a / b: the last one the data could tell
        self.samples = 0
        self._pp = self._pg = self._gg = self._py = self._gy = 0.0

    def observe(self, prompt_tokens: float, generated_tokens: float, busy_s: float) -> None:
        """One interval's work and engine time (skipped when the engine was nearly idle)."""
        if busy_s < MIN_BUSY_S or prompt_tokens < 0 or generated_tokens < 0 or prompt_tokens + generated_tokens <= 0:
            return
        d, p, g, y = self.decay, float(prompt_tokens), float(generated_tokens), float(busy_s)
        self._pp = d * self._pp + p * p
        self._pg = d * self._pg + p * g
        self._gg = d * self._gg + g * g
        self._py = d * self._py + p * y
        self._gy = d * self._gy + g * y
        self.samples += 1

    def estimate(self) -> Speed | None:
        if self.samples == 0:
            return None
        a, b = self._solve()
        return Speed(prefill_tps=1.0 / a, decode_tps=1.0 / b, samples=self.samples)

    def _solve(self) -> tuple[float, float]:
        """(a, b) seconds per prompt / generated token; both > 0."""
        pp, pg, gg, py, gy = self._pp, self._pg, self._gg, self._py, self._gy
        det = pp * gg - pg * pg
        if pp > 0 and gg > 0 and det > _ILL_CONDITIONED * pp * gg:
            a, b = (py * gg - gy * pg) / det, (gy * pp - py * pg) / det
            if a > 0 and b > 0:
                self.ratio = a / b
                return a, b
        # One scale on the known ratio: y = b * (ratio * P + G).
        r = self.ratio
        xx = r * r * pp + 2 * r * pg + gg
        b = (r * py + gy) / xx if xx > 0 else 0.0
        b = b if b > 0 else 1e-6
        return r * b, b
