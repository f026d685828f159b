"""The routing constraints a request can set (pinned worker, minimum capability, fp8
convention): how each is matched, described and refused, on simulated workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.config.settings import RouterSettings
from server.fleet.handle import WorkerHandle
from server.fleet.spec import build_worker_specs
from server.routing.filter import ConstraintError, Constraints, matches, parse_capability, parse_constraints
from workers.contract import CapabilityPayload, WorkerState, parse_simulate


def _handles(spec: str = "sm_80,sm_89,sm_90") -> list[WorkerHandle]:
    settings = RouterSettings(worker_command=("python", "-m", "workers"))
    handles = []
    for s in build_worker_specs(parse_simulate(spec), settings, Path("/tmp/run"), parent_pid=42, base_env={}):
        h = WorkerHandle(s, state=WorkerState.READY)
        native = s.device.capability is not None and s.device.capability >= (8, 9)
        h.info = CapabilityPayload(fp8={"convention": "native_e4m3" if native else "emulated", "reason": "test"})
        handles.append(h)
    return handles


def test_each_constraint_matches_or_says_why_not():
    sm80, sm89, sm90 = _handles()
    assert matches(sm90, Constraints(worker="gpu2", min_capability=(9, 0), fp8="native_e4m3")) == (True, "matches")
    assert matches(sm80, Constraints()) == (True, "matches")
    assert matches(sm80, Constraints(worker="GPU2")) == (False, "gpu0 has another id, index and UUID")
    assert matches(sm89, Constraints(worker=sm89.spec.device.uuid.upper())) == (True, "matches")
    assert matches(sm89, Constraints(min_capability=(8, 9)))[0] is True  # at the minimum is enough
    assert matches(sm80, Constraints(min_capability=(8, 9))) == (False, "gpu0 has capability 8.0")
    assert matches(sm89, Constraints(fp8="emulated")) == (False, "gpu1 uses fp8 native_e4m3")
    sm89.info = None
    assert matches(sm89, Constraints(fp8="emulated")) == (None, "gpu1 has not reported its fp8 convention yet")


def test_a_cpu_worker_never_meets_a_minimum_capability():
    (cpu,) = _handles("cpu")
    assert matches(cpu, Constraints(min_capability=(7, 0))) == (False, "cpu0 has capability cpu")


def test_constraints_describe_themselves_for_the_422():
    c = Constraints(worker="gpu1", min_capability="sm_89", fp8="native_e4m3")
    assert c.describe() == "worker `gpu1`, capability >= `8.9`, fp8 `native_e4m3`"
    assert Constraints(fp8="emulated").describe() == "fp8 `emulated`"
    assert Constraints().describe() == "none" and not Constraints() and Constraints(worker="0")


@pytest.mark.parametrize(
    ("value", "expected"), [("8.9", (8, 9)), (" SM_90 ", (9, 0)), ("sm_100", (10, 0)), ("12.0", (12, 0))]
)
def test_minimum_capability_spellings(value, expected):
    assert parse_capability(value) == expected


@pytest.mark.parametrize("value", ["9", "90", "9.", "sm_", "sm_9x", "9.10", "fast"])
def test_bad_minimum_capability_names_the_value_and_the_accepted_forms(value):
    with pytest.raises(ConstraintError, match=rf"^Invalid minimum capability `{value}`\. Accepted: `X\.Y`"):
        parse_capability(value)


def test_fp8_header_aliases_and_the_refusal():
    for raw in ("native", "NATIVE_E4M3", "e4m3"):
        assert parse_constraints({"x-hetserve-fp8": raw}).fp8 == "native_e4m3"
    assert parse_constraints({"x-hetserve-fp8": "Emulated"}).fp8 == "emulated"
    assert parse_constraints({"x-hetserve-fp8": " ", "x-hetserve-worker": "", "x-hetserve-min-capability": ""}) == (
        Constraints()
    )
    with pytest.raises(ConstraintError, match="^Invalid fp8 convention `e5m2`. Accepted: native_e4m3, emulated$"):
        parse_constraints({"x-hetserve-fp8": "e5m2"})
