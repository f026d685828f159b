"""The second lane's result (tests/second_lane.py): its child pytest ran every test it was given, and all passed."""

from __future__ import annotations

import pytest

from tests import second_lane

TIMEOUT_S = 2400  # from the end of the main session's own tests


def test_the_second_lane_passed():
    if not second_lane.started():
        pytest.skip("the second lane runs only when the suite runs whole (tests/conftest.py)")
    proc = second_lane.result(TIMEOUT_S)
    tail = proc.stdout[-8000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    last = [line for line in proc.stdout.strip().splitlines() if line.strip()][-1]
    assert " passed" in last and "failed" not in last and "error" not in last, tail
