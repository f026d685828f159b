"""The host KV tier's directory as the router keeps it (server/fleet/kv_tier_dir.py) and the
worker configuration that names it (server/fleet/spec.py, server/config/settings.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from server.cli import build_parser
from server.config.settings import RouterSettings
from server.errors import UsageError
from server.fleet.kv_tier_dir import (
    make_tier_dir,
    remove_tier_dir,
    sweep_stale_tier_dirs,
    tier_dir_for,
    tier_parent,
)
from server.fleet.spec import build_worker_specs
from workers.contract import KV_TIER_PREFIX, RUN_DIR_MARKER, parse_simulate


def test_the_tier_lives_in_dev_shm_named_after_the_run_directory(tmp_path):
    run = tmp_path / "hetserve-123-abc"
    assert tier_dir_for(run, tmp_path).name == f"{KV_TIER_PREFIX}hetserve-123-abc"
    if os.access("/dev/shm", os.W_OK):
        assert str(tier_parent()) == "/dev/shm"
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    assert tier_parent(blocked) != blocked, "a /dev/shm that cannot be written falls back to the temp dir"


def test_made_marked_and_removed(tmp_path):
    run = tmp_path / f"hetserve-{os.getpid()}-x"
    path, why = make_tier_dir(run, tmp_path)
    assert why is None and (path / RUN_DIR_MARKER).is_file()
    assert oct(path.stat().st_mode & 0o777) == "0o700"
    remove_tier_dir(run, tmp_path)
    assert not path.exists()
    blocked = tmp_path / "file"
    blocked.write_text("")
    _, why = make_tier_dir(run, blocked)
    assert why and "cannot be made" in why


def test_the_tiers_of_dead_routers_are_swept_and_nothing_else(tmp_path):
    """Guards the tier sweep at start (`sweep_stale_tier_dirs`): a server killed with -9 leaves its
    tier in /dev/shm; the next start removes it, not a live router's, nor an unmarked folder."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale, _ = make_tier_dir(tmp_path / f"hetserve-{dead.stdout.strip()}-abc", tmp_path)
    live, _ = make_tier_dir(tmp_path / f"hetserve-{os.getpid()}-def", tmp_path)
    (stale / "ab").mkdir()
    (stale / "ab" / "block.kvb").write_bytes(b"x")
    unmarked = tmp_path / f"{KV_TIER_PREFIX}hetserve-{dead.stdout.strip()}-zzz"
    unmarked.mkdir()
    assert sweep_stale_tier_dirs(tmp_path) == [stale]
    assert not stale.exists() and live.exists() and unmarked.exists()


def _settings(*argv: str) -> RouterSettings:
    args = build_parser().parse_args(["serve", *argv])
    return RouterSettings.from_args(args)


def test_kv_host_bytes_reaches_every_worker_with_the_runs_tier(tmp_path):
    settings = _settings("--kv-host-bytes", "1048576")
    specs = build_worker_specs(parse_simulate("sm_80,sm_90"), settings, tmp_path / "hetserve-1-a", parent_pid=7)
    dirs = {s.config.kv_host_dir for s in specs}
    assert len(dirs) == 1 and dirs.pop().endswith(f"{KV_TIER_PREFIX}hetserve-1-a"), "one tier for the run"
    assert {s.config.kv_host_bytes for s in specs} == {1 << 20}
    off = build_worker_specs(parse_simulate("sm_80"), _settings("--kv-host-bytes", "0"), tmp_path, 7)
    assert (off[0].config.kv_host_bytes, off[0].config.kv_host_dir) == (0, None)
    default = build_worker_specs(parse_simulate("sm_80"), _settings(), tmp_path, 7)
    assert default[0].config.kv_host_bytes is None and default[0].config.kv_host_dir is not None


def test_a_negative_budget_is_refused_naming_the_flag():
    with pytest.raises(UsageError, match=r"`--kv-host-bytes -1` must be >= 0"):
        _settings("--kv-host-bytes", "-1")


def test_a_conversation_continues_on_a_worker_sharing_the_host_tier_of_the_one_that_held_it():
    """Guards `Router._held_tokens`' tier term: when the worker holding a conversation cannot take
    its next turn, the worker that shares its host KV tier counts the prefix as held (at
    `TIER_HIT_WEIGHT`) and wins over a worker that would recompute it; `/workers` says who shares."""
    from server.config.routing import TIER_HIT_WEIGHT
    from server.routing.router import Router
    from tests.test_routing_policy import CHUNK, _handles, _send, _text
    from workers.contract import WorkerState

    router, hs = Router(), _handles()
    tier = {"enabled": True, "directory": "/dev/shm/hetserve-kv-x/abc", "format_key": "abc"}
    for h in (hs[0], hs[2]):  # gpu0 and gpu2 share a tier; gpu1 has none
        h.info.capacity["kv_host_tier"] = dict(tier)
    history = _text(6, "conversation")
    first = _send(router, hs, {"inputs": history})
    assert first.worker is hs[0]
    first.end()
    hs[0].state = WorkerState.UNHEALTHY
    later = _send(router, hs, {"inputs": history + _text(2, "turn2")})
    assert later.worker is hs[2], "without the tier gpu1 would win the tie (fewer picks, lower id)"
    assert later.route.header == f"prefix:{int(TIER_HIT_WEIGHT * 6 * CHUNK / 4.0)}"
    assert router.snapshot(hs[2])["host_tier"] == {"shared_with": ["gpu0"], "prefix_chunks": 8}
    assert "host_tier" not in router.snapshot(hs[1])
