"""One capability type for both processes: `Capability(9, 0)`, parsed from any spelling.

A GPU's capability is written four ways across the stack: torch's `(9, 0)`, the `kernels`
library's integer `90`, the `/workers` label `"9.0"` and the architecture token `"sm_90"`.
`Capability.parse` reads all of them (and an existing `Capability`) with one error message,
and the value answers in each form (`.label`, `.sm`, `.int`), so no module converts by hand.

Design: a `NamedTuple` rather than a frozen dataclass. It is just as immutable and ordered,
and it also equals, sorts and unpacks like the `(major, minor)` tuples that torch returns
and older callers pass, so adopting it changes no comparison anywhere. The trade-off: a
`Capability` compares equal to a plain tuple, so the type alone does not prove that a value
went through `parse`.
"""

from __future__ import annotations

from typing import NamedTuple

ACCEPTED_CAPABILITY_SPELLINGS = '(9, 0), 90, "9.0" or "sm_90"'


class CapabilityError(ValueError):
    """A capability in a spelling none of the accepted ones matches."""


class Capability(NamedTuple):
    """A CUDA compute capability (or a ROCm arch read as major.minor, e.g. gfx942 -> 9.4)."""

    major: int
    minor: int

    @classmethod
    def parse(cls, value) -> Capability:
        """`(9, 0)`, `[9, 0]`, `90`, `"90"`, `"9.0"`, `"sm_90"` (any case) -> `Capability(9, 0)`."""
        if isinstance(value, Capability):
            return value
        if isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_int(v) for v in value):
            return cls._checked(int(value[0]), int(value[1]), value)
        if _is_int(value):
            return cls._checked(*divmod(int(value), 10), value)
        if isinstance(value, str):
            text = value.strip().lower().removeprefix("sm_")
            major, dot, minor = text.partition(".")
            if dot and major.isdigit() and minor.isdigit() and len(minor) == 1:
                return cls._checked(int(major), int(minor), value)
            if not dot and text.isdigit() and len(text) >= 2:
                return cls._checked(int(text[:-1]), int(text[-1]), value)
        raise CapabilityError(_not_understood(value))

    @classmethod
    def parse_optional(cls, value) -> Capability | None:
        """`parse`, with None (a CPU, which has no capability) passed through."""
        return None if value is None else cls.parse(value)

    @classmethod
    def _checked(cls, major: int, minor: int, original) -> Capability:
        if major < 0 or not 0 <= minor <= 9:
            raise CapabilityError(_not_understood(original))
        return cls(major, minor)

    @property
    def label(self) -> str:
        """`"9.0"`: how `/workers`, metrics labels and response headers show it."""
        return f"{self.major}.{self.minor}"

    @property
    def sm(self) -> str:
        """`"sm_90"`: the CUDA architecture token (`--simulate`, compiler targets)."""
        return f"sm_{self.major}{self.minor}"

    @property
    def int(self) -> int:
        """`90`: how the `kernels` library encodes capabilities."""
        return self.major * 10 + self.minor

    def __str__(self) -> str:
        return self.label


def _not_understood(value) -> str:
    return f"Capability `{value!r}` is not understood. Accepted: {ACCEPTED_CAPABILITY_SPELLINGS}"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def capability_label(capability: Capability | None) -> str:
    """The `capability` label of a worker: `"9.0"`, or `"cpu"` for a device without one."""
    return "cpu" if capability is None else Capability.parse(capability).label
