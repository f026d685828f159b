"""The `HETSERVE_SLOWDOWN` value (benchmarks and tests only): each simulated device's factor.

The router reads it once and uses each factor twice: in the worker's configuration (the
simulated device slows its own forward passes by it: workers/device/slowdown.py) and to weigh a
pipeline stage's speed (server/fleet/pipelines.py). Only a simulated device is slowed, so
`device_slowdown` gives every other device 1. Parsed here once, torch-free.
"""

from __future__ import annotations

ENV_SLOWDOWN = "HETSERVE_SLOWDOWN"


def slowdown_factor(spec: str, worker_id: str) -> float:
    """This worker's factor in a `HETSERVE_SLOWDOWN` value (1.0 when it is not listed)."""
    spec = spec.strip()
    if not spec:
        return 1.0
    factors: dict[str | None, str] = {}
    for part in spec.split(","):
        name, sep, value = part.strip().rpartition("=")
        factors[name.strip() if sep else None] = value.strip()
    raw = factors.get(worker_id, factors.get(None, "1"))
    try:
        factor = float(raw)
    except ValueError:
        factor = float("nan")
    if not factor >= 1.0 or factor == float("inf"):
        raise ValueError(f"Invalid {ENV_SLOWDOWN} factor `{raw}` for worker `{worker_id}`. Accepted: a number >= 1, "
                         f"as `3` (every worker) or `gpu0=3,gpu2=1.5`")
    return factor


def device_slowdown(spec: str, worker_id: str, simulated: bool) -> float:
    """The factor a device's worker runs slowed by: its `slowdown_factor` when it is simulated, else 1."""
    return slowdown_factor(spec, worker_id) if simulated else 1.0
