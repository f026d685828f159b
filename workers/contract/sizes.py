"""Byte sizes as people write them (`24GiB`, `512MiB`, `80GB`) and as hetserve prints them.

Design: one parser for every size a user types (a simulated device's memory in `--simulate
sm_86:24GiB`) and one formatter that round-trips (`format_size(parse_size(s))` parses back
to the same bytes), so a size handed from the router to a worker on a command line is never
rounded. `human(n)` is for reading only (`1.5 GiB`), never parsed back. Trade-off: binary
units (KiB, MiB, GiB, TiB) are what GPUs report and what the formatter writes; decimal ones
(KB, MB, GB, TB) are accepted because vendors print them, and mean powers of 1000.
"""

from __future__ import annotations

import re

UNITS = {
    "B": 1,
    "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
}
ACCEPTED_SIZES = "a number and a unit: B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB), e.g. 24GiB or 512MiB"

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*$")
_CASEFOLD = {unit.lower(): unit for unit in UNITS}


class SizeError(ValueError):
    """A size that cannot be understood, or that is not positive."""


def parse_size(text: str) -> int:
    """`24GiB` -> 25769803776 bytes (units are case-insensitive: `24gib` too); `SizeError`
    naming the value otherwise. Fractions are allowed (`1.5GiB`); the result is whole bytes."""
    m = _SIZE_RE.match(text or "")
    unit = _CASEFOLD.get(m.group(2).lower()) if m else None
    if m is None or unit is None:
        raise SizeError(f"Invalid size `{text}`. Accepted: {ACCEPTED_SIZES}")
    value = int(float(m.group(1)) * UNITS[unit])
    if value <= 0:
        raise SizeError(f"Size `{text}` must be more than 0 bytes. Accepted: {ACCEPTED_SIZES}")
    return value


def format_size(n: int) -> str:
    """The exact size in the largest binary unit that divides it: `24GiB`, `1536MiB`, `1000B`."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n % UNITS[unit] == 0:
            return f"{n // UNITS[unit]}{unit}"
    return f"{n}B"


def human(n: int | float) -> str:
    """`1.5 GiB`, `512 MiB`, `980 B`: three significant digits, for messages and tables."""
    n = float(n)
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if abs(n) >= UNITS[unit]:
            value = n / UNITS[unit]
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
    return f"{n:.0f} B"
