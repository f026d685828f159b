"""Simulated topology, `--devices` selection and `hetserve devices`, run as the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from workers.contract import TopologySpecError, parse_simulate, parse_token, select_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hetserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "token,expected",
    [("sm_75", ("cuda", (7, 5))), ("sm_80", ("cuda", (8, 0))), ("sm_89", ("cuda", (8, 9))),
     ("sm_90", ("cuda", (9, 0))), ("sm_100", ("cuda", (10, 0))), ("sm_120", ("cuda", (12, 0))),
     ("gfx90a", ("rocm", (9, 0))), ("gfx942", ("rocm", (9, 4))), ("gfx1100", ("rocm", (11, 0))),
     ("cpu", ("cpu", None)), (" SM_90 ", ("cuda", (9, 0)))],
)
def test_tokens(token, expected):
    assert parse_token(token) == expected


@pytest.mark.parametrize("bad", ["sm_8x", "gfx", "sm_", "sm_1", "h100", "sm_80,", ""])
def test_bad_simulate_specs_name_the_value(bad):
    with pytest.raises(TopologySpecError) as e:
        parse_simulate(bad)
    assert "Accepted" in str(e.value)


def test_select_devices_by_index_and_uuid_keeps_order():
    inv = parse_simulate("sm_80,sm_89,sm_90")
    assert [d.index for d in select_devices(inv, "2,0")] == [2, 0]
    assert select_devices(inv, inv[1].uuid.lower()) == [inv[1]]
    assert select_devices(inv, "all") == inv
    for bad, match in [("3", "`3` is out of range"), ("GPU-nope", "Unknown GPU UUID `GPU-nope`"),
                       ("x", "Invalid device `x`"), ("0,0", "listed twice")]:
        with pytest.raises(TopologySpecError, match=match):
            select_devices(inv, bad)


def test_devices_json_lists_three_simulated_devices():
    r = hetserve("devices", "--simulate", "sm_80,sm_89,sm_90", "--json")
    assert r.returncode == 0, r.stderr
    devs = json.loads(r.stdout)["devices"]
    assert [d["capability"] for d in devs] == ["8.0", "8.9", "9.0"]
    for d in devs:
        assert {"index", "uuid", "name", "capability", "memory_total_bytes", "simulated"} <= d.keys()
        assert d["simulated"] is True
    assert len({d["uuid"] for d in devs}) == 3


@pytest.mark.parametrize(
    "args,needle",
    [(["devices", "--simulate", "sm_8x"], "`sm_8x`"),
     (["devices", "--simulate", "gfx"], "`gfx`"),
     (["devices", "--simulate", "sm_80", "--devices", "4"], "`4`"),
     (["devices", "--simulate", "sm_80", "--devices", "GPU-deadbeef"], "`GPU-deadbeef`")],
)
def test_bad_input_is_one_line_exit_2_no_traceback(args, needle):
    r = hetserve(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0]
    assert any(word in lines[0] for word in ("Accepted", "Known", "indices"))
    assert "Traceback" not in r.stderr


def test_every_subcommand_has_help():
    for sub in ("serve", "plan", "compose", "devices"):
        r = hetserve(sub, "--help")
        assert r.returncode == 0 and "usage: hetserve" in r.stdout, sub


@pytest.mark.parametrize("form", [(9, 0), [9, 0], 90, "9.0", "sm_90", " SM_90 "])
def test_capability_forms_agree(form):
    from kernels_local.mapping import select
    from workers.contract import Capability
    from workers.quant.fp8_convention import choose_fp8

    assert Capability.parse(form) == (9, 0)
    assert select("cuda", form) == select("cuda", (9, 0))
    assert choose_fp8("cuda", form) == choose_fp8("cuda", (9, 0))


def test_capability_forms_of_newer_archs_and_bad_values():
    from workers.contract import Capability

    assert Capability.parse(100) == (10, 0) and Capability.parse("12.0") == (12, 0)
    assert Capability.parse_optional(None) is None
    for bad in ("x", -1, True, 9.0):
        with pytest.raises(ValueError, match="is not understood"):
            Capability.parse(bad)
