"""The host KV tier's directory of one router run: made at start, removed at stop, swept when stale.

Workers of the same model and KV format share blocks through files in one directory
(workers/kvtier/store.py); the router owns its life. It lies in /dev/shm (memory, not disk;
the system's temporary directory where /dev/shm cannot be written), named after the run
directory, `hetserve-kv-hetserve-<router pid>-<random>`, and holds the same marker file, so a
router starting after one killed with -9 removes that one's tier as it removes its run
directory (server/fleet/run_dir.py), and nothing else. Trade-off: the tier lives no longer than
its router: a restarted server starts with an empty tier rather than trusting blocks it did
not see written."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from server.fleet.run_dir import RUN_DIR_PREFIX, sweep_stale_run_dirs
from workers.contract import KV_TIER_PREFIX, RUN_DIR_MARKER

SHM = Path("/dev/shm")


def tier_parent(shm: Path = SHM) -> Path:
    """Where tiers live on this host: /dev/shm when it is a directory this user can write."""
    return shm if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else Path(tempfile.gettempdir())


def tier_dir_for(run_dir: Path, parent: Path | None = None) -> Path:
    return (parent or tier_parent()) / f"{KV_TIER_PREFIX}{run_dir.name}"


def make_tier_dir(run_dir: Path, parent: Path | None = None) -> tuple[Path, str | None]:
    """The run's tier directory, made (0700, marked) now; and why not, when it cannot be (the
    workers then report the tier off with their own reason)."""
    path = tier_dir_for(run_dir, parent)
    try:
        path.mkdir(mode=0o700)
        (path / RUN_DIR_MARKER).write_text(f"hetserve router pid {os.getpid()}: host KV tier\n")
    except OSError as e:
        return path, f"`{path}` cannot be made: {e.strerror or e}"
    return path, None


def remove_tier_dir(run_dir: Path, parent: Path | None = None) -> None:
    shutil.rmtree(tier_dir_for(run_dir, parent), ignore_errors=True)


def sweep_stale_tier_dirs(parent: Path | None = None) -> list[Path]:
    """Remove the tiers of routers that died without cleaning up (the run directory's rule)."""
    return sweep_stale_run_dirs(parent or tier_parent(), prefix=f"{KV_TIER_PREFIX}{RUN_DIR_PREFIX}")
