"""Disaggregated prefill's flags and roles: `--disaggregate auto|off`, `--prefill`, `--decode`,
`--disaggregate-min-prompt` (server/config/disaggregate.py), the roles resolved against the
workers (server/routing/roles.py), and which workers an ordinary request leaves out
(server/dispatch/handoff.py `Disaggregation.held_back`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from server.cli import build_parser
from server.config.disaggregate import AUTO, DEFAULT_MIN_PROMPT_TOKENS, EXPLICIT, OFF, disaggregate_from_args
from server.config.settings import RouterSettings
from server.dispatch.handoff import Disaggregation, disaggregation
from server.errors import UsageError
from server.fleet.spec import worker_id
from server.routing.filter import Constraints
from server.routing.roles import AUTO_MIN_ADVANTAGE, BOTH, DECODE, PREFILL, auto_roles, resolve_roles
from workers.contract import parse_simulate


def _config(*argv: str):
    return disaggregate_from_args(build_parser().parse_args(["serve", *argv]))


def _workers(spec: str) -> dict:
    return {worker_id(d): d for d in parse_simulate(spec)}


# --- flags ----------------------------------------------------------------------------------
def test_the_default_is_off_and_explicit_roles_turn_it_on():
    assert _config().mode == OFF and not _config().enabled
    assert _config().min_prompt_tokens == DEFAULT_MIN_PROMPT_TOKENS
    c = _config("--prefill", "gpu0", "--decode", "gpu1, gpu2", "--disaggregate-min-prompt", "64")
    assert (c.mode, c.prefill, c.decode, c.min_prompt_tokens) == (EXPLICIT, ("gpu0",), ("gpu1", "gpu2"), 64)
    assert _config("--disaggregate", "AUTO").mode == AUTO


@pytest.mark.parametrize(("argv", "named"), [
    (("--disaggregate", "sometimes"), "`--disaggregate sometimes`"),
    (("--disaggregate", "off", "--prefill", "gpu0"), "`--disaggregate off`"),
    (("--disaggregate", "auto", "--decode", "gpu1"), "`--disaggregate auto`"),
    (("--prefill", "gpu0,,gpu1"), "`--prefill gpu0,,gpu1`"),
    (("--decode", "gpu1,GPU1"), "`--decode gpu1,GPU1`"),
    (("--disaggregate-min-prompt", "0"), "`--disaggregate-min-prompt 0`"),
])
def test_a_bad_value_is_a_usage_error_that_names_it_and_what_is_accepted(argv, named):
    with pytest.raises(UsageError) as e:
        _config(*argv)
    message = str(e.value)
    assert named in message and ("Accepted" in message or "must be" in message), message


def test_disaggregation_without_the_host_tier_is_refused():
    """Guards the check in `RouterSettings.from_args`: the handoff moves KV through the tier."""
    for off in (["--kv-host-bytes", "0"], ["--no-prefix-cache"]):
        with pytest.raises(UsageError, match="host KV tier"):
            RouterSettings.from_args(build_parser().parse_args(["serve", "--prefill", "gpu0", *off]))


# --- roles ----------------------------------------------------------------------------------
def test_explicit_roles_name_workers_by_id_index_or_uuid_and_the_unlisted_take_the_other_role():
    workers = _workers("sm_80,sm_75,sm_75")
    uuid = workers["gpu2"].uuid
    roles = resolve_roles(_config("--prefill", "0", "--decode", f"gpu1,{uuid.upper()}"), workers)
    assert roles.by_worker == {"gpu0": PREFILL, "gpu1": DECODE, "gpu2": DECODE} and roles.active
    only_prefill = resolve_roles(_config("--prefill", "gpu0"), workers)
    assert only_prefill.by_worker == {"gpu0": PREFILL, "gpu1": DECODE, "gpu2": DECODE}
    both = resolve_roles(_config("--prefill", "gpu0,gpu1", "--decode", "gpu1"), workers)
    assert both.by_worker == {"gpu0": PREFILL, "gpu1": BOTH, "gpu2": BOTH}


def test_explicit_roles_that_name_no_worker_or_leave_a_phase_without_one_are_refused():
    workers = _workers("sm_80,sm_75")
    with pytest.raises(UsageError, match=r"`--prefill gpu7` names no worker. Accepted: gpu0, gpu1"):
        resolve_roles(_config("--prefill", "gpu7"), workers)
    with pytest.raises(UsageError, match="leaves no worker to decode"):
        resolve_roles(_config("--prefill", "gpu0,gpu1"), workers)
    with pytest.raises(UsageError, match="leaves no worker to prefill"):
        resolve_roles(_config("--decode", "gpu0,gpu1"), workers)


@pytest.mark.parametrize(("spec", "expected"), [
    ("sm_89,sm_80", {"gpu0": BOTH, "gpu1": DECODE}),  # L40S computes, A100 streams memory: 2.7
    ("sm_80,sm_89,sm_80", {"gpu0": DECODE, "gpu1": BOTH, "gpu2": DECODE}),
    ("sm_90,sm_75", {}),  # an H100 is faster at both than a T4: 1.45, not worth splitting
    ("sm_80,sm_80", {}),  # identical devices keep today's routing
    ("sm_80,cpu", {}),  # no card: nothing to compare
    ("sm_80", {}),
])
def test_auto_splits_only_where_each_device_is_better_at_its_own_phase(spec, expected):
    roles = auto_roles(_workers(spec))
    assert dict(roles.by_worker) == expected, roles.reason
    assert roles.active == bool(expected)
    assert roles.reason.startswith("auto: ") and (bool(expected) or "not disaggregated" in roles.reason)
    if "sm_75" in spec:
        assert f"< {AUTO_MIN_ADVANTAGE:g}" in roles.reason


def test_off_gives_no_handoff_and_explicit_roles_give_one():
    devices = parse_simulate("sm_80,sm_75")
    settings = RouterSettings()
    assert disaggregation(settings, devices, {0: None, 1: None}) is None
    on = RouterSettings(disaggregate=_config("--prefill", "gpu0"))
    d = disaggregation(on, devices, {0: None, 1: None})
    assert d.describe("gpu0")["role"] == PREFILL and d.describe("gpu1")["role"] == DECODE


# --- ordinary requests --------------------------------------------------------------------
def _handle(wid: str, routable: bool = True, generation: int = 1):
    return SimpleNamespace(id=wid, routable=routable, generation=generation)


def test_an_ordinary_request_leaves_the_prefill_only_workers_out_while_another_can_take_it():
    """Guards `held_back` as `Dispatcher._with_retries` applies it."""
    d = Disaggregation(resolve_roles(_config("--prefill", "gpu0"), _workers("sm_80,sm_75,sm_75")), 16, 8)
    workers = [_handle("gpu0", generation=3), _handle("gpu1"), _handle("gpu2")]
    assert d.held_back(workers, Constraints()) == {"gpu0": 3}
    assert d.held_back(workers, Constraints(worker="gpu0")) == {}  # the client named its worker
    down = [_handle("gpu0"), _handle("gpu1", routable=False), _handle("gpu2", routable=False)]
    assert d.held_back(down, Constraints()) == {}  # no decode worker is up: the prefill worker serves


def test_a_worker_that_does_both_beside_a_decode_worker_still_hands_long_prompts_off():
    """Guards `Roles.active` counting a decode-only worker: the fast card prefills and decodes,
    the slow one only decodes (long prompts are never prefilled there)."""
    roles = resolve_roles(_config("--prefill", "gpu0", "--decode", "gpu0,gpu1"), _workers("sm_90,sm_75"))
    assert roles.by_worker == {"gpu0": BOTH, "gpu1": DECODE} and roles.active
    assert not resolve_roles(_config("--prefill", "gpu0,gpu1", "--decode", "gpu0,gpu1"), _workers("sm_90,sm_75")).active


def test_refused_casts_of_another_dtypes_blocks_are_a_metric_per_worker():
    """Guards `ForeignCastCollector`: the workers' `/health` counts become a router series, with
    every per-worker series' labels (worker, capability, model)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from server.fleet.metrics import ForeignCastCollector

    tier = {"kv_host_tier": {"foreign": {"casts_refused": 3, "blocks_converted": 5}}}
    workers = [SimpleNamespace(id="gpu1", capability_label="7.5", model="tiny", info=None, live_capacity=tier),
               SimpleNamespace(id="gpu0", capability_label="9.0", model="tiny", info=None,
                               live_capacity={"kv_host_tier": {"enabled": True}})]
    registry = CollectorRegistry()
    registry.register(ForeignCastCollector(lambda: workers))
    text = generate_latest(registry).decode()
    series = 'capability="7.5",model="tiny",reason="kv_cast_not_exact",worker_id="gpu1"'
    assert f"hetserve_kv_tier_foreign_casts_refused_total{{{series}}} 3.0" in text
    assert 'worker_id="gpu0"' not in text


def test_auto_counts_a_simulated_device_slowed_on_purpose_as_the_card_it_plays():
    """Guards `slowed` in `auto_roles`: three sm_90s are identical on paper, but two slowed to a
    card of an eighth of the compute and half the bandwidth are the slow-compute cards they play."""
    from workers.contract.slowdown import Slowdown

    workers = _workers("sm_90,sm_90,sm_90")
    slow = Slowdown(8.0, 2.0)
    assert not auto_roles(workers).active
    roles = auto_roles(workers, {"gpu1": slow, "gpu2": slow})
    assert dict(roles.by_worker) == {"gpu0": BOTH, "gpu1": DECODE, "gpu2": DECODE}
    assert "(slowed prefill 8x, decode 2x)" in roles.reason and "comparative advantage 4.00" in roles.reason
