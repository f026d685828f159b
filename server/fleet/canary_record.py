"""What the canary last concluded about one worker: the record its handle keeps, and its gauges.

The canary (server/canary/) computes a verdict; the worker's handle keeps it across the
worker's life (`/workers` `canary`, `/health`'s `canary_suspects`, the routing filter skipping a
held worker), so the record belongs to the router's view of its workers, here, next to the
breaker and the probe verdict. `CanaryCollector` reads the records at scrape time
(`hetserve_canary_*` in `/metrics`). Plain values, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily

HEALTHY, SUSPECT = "healthy", "suspect"
# Why a worker that has not had its first canary check yet is kept out of rotation.
FIRST_CHECK = "canary: first check before serving"


@dataclass(frozen=True)
class CanaryRecord:
    """A worker's last canary check (`/workers` `canary`, `/metrics` `hetserve_canary_*`)."""

    generation: int  # the worker process it checked
    checked_at: float  # unix time
    verdict: str  # healthy | suspect
    reason: str
    expected: str  # "exact" or ">= <min agreement>"
    agreement: float
    max_logprob_diff: float
    positions: int
    reference: dict  # `Reference.describe()`
    peers: tuple[tuple[str, float], ...] = ()  # (other worker, agreement with its last scores)

    @property
    def suspect(self) -> bool:
        return self.verdict == SUSPECT

    def snapshot(self) -> dict:
        return {"verdict": self.verdict, "reason": self.reason, "expected": self.expected,
                "agreement": round(self.agreement, 6), "max_logprob_diff": _rounded(self.max_logprob_diff),
                "positions": self.positions, "checked_at": round(self.checked_at, 3),
                "reference": self.reference, "peers": {w: round(a, 6) for w, a in self.peers}}


def _rounded(value: float) -> float | str:
    return round(value, 6) if math.isfinite(value) else "inf"


class CanaryCollector:
    """`hetserve_canary_*` gauges, read from the workers' canary records at scrape time."""

    _LABELS = ("worker_id", "capability", "model", "fp8")

    def __init__(self, workers_fn):
        self._workers_fn = workers_fn

    def collect(self):
        agreement = GaugeMetricFamily("hetserve_canary_agreement",
                                      "Fraction of the canary's positions where the worker's best token equals "
                                      "the reference's.", labels=self._LABELS)
        diff = GaugeMetricFamily("hetserve_canary_max_logprob_diff",
                                 "Largest logprob difference from the reference at the last canary check.",
                                 labels=self._LABELS)
        suspect = GaugeMetricFamily("hetserve_canary_suspect", "1 while the canary finds the worker suspect.",
                                    labels=self._LABELS)
        checked = GaugeMetricFamily("hetserve_canary_last_check_timestamp_seconds",
                                    "Unix time of the worker's last canary check.", labels=self._LABELS)
        for h in self._workers_fn():
            record = h.canary
            if record is None:
                continue
            labels = [h.id, h.capability_label, h.model, h.fp8_convention or "unknown"]
            agreement.add_metric(labels, record.agreement)
            diff.add_metric(labels, record.max_logprob_diff)
            suspect.add_metric(labels, 1.0 if record.suspect else 0.0)
            checked.add_metric(labels, record.checked_at)
        yield from (agreement, diff, suspect, checked)
