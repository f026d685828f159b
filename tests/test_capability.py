"""`Capability.parse`: every accepted spelling, and every other value refused with its own
name in the message (the router's headers, `--simulate` and the kernel mapping all parse here)."""

from __future__ import annotations

import pytest

from workers.contract import ACCEPTED_CAPABILITY_SPELLINGS, Capability, CapabilityError, capability_label


@pytest.mark.parametrize(
    ("value", "expected"),
    [((9, 0), (9, 0)), ([8, 9], (8, 9)), (90, (9, 0)), (100, (10, 0)), ("90", (9, 0)), ("8.9", (8, 9)),
     ("SM_120", (12, 0)), (" sm_75 ", (7, 5)), (Capability(8, 0), (8, 0)), ((0, 0), (0, 0)), ((9, 9), (9, 9))],
)  # fmt: skip
def test_accepted_spellings(value, expected):
    cap = Capability.parse(value)
    assert cap == expected and type(cap) is Capability


@pytest.mark.parametrize(
    "value",
    [(-1, 0), (9, 10), (9, -1), (True, 0), (9.0, 0), [9], (9, 0, 1), -1, True, 9.0, "9", "9.10", "9.x", "sm_",
     "sm_9", "", "x", None],
)  # fmt: skip
def test_every_other_value_is_named(value):
    with pytest.raises(CapabilityError, match=r"^Capability `(.+)` is not understood\. Accepted: ") as info:
        Capability.parse(value)
    assert str(info.value) == f"Capability `{value!r}` is not understood. Accepted: {ACCEPTED_CAPABILITY_SPELLINGS}"


def test_optional_and_label():
    assert Capability.parse_optional(None) is None and Capability.parse_optional("9.0") == (9, 0)
    assert capability_label(None) == "cpu" and capability_label(89) == "8.9"
    cap = Capability.parse("sm_89")
    assert (cap.label, cap.sm, cap.int, str(cap)) == ("8.9", "sm_89", 89, "8.9")
