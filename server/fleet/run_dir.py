"""The router's private run directory: worker sockets and status files, mode 0700.

Named `hetserve-<router pid>-<random>` under the temporary directory and holding a marker file
written first, so a new router can tell the directories of routers that died without cleaning
up (SIGKILL) from those of routers still running, and both from anything else that happens to
match the name (another program's folder, a link), and sweep only the first. Trade-off: the
sweep trusts the pid in the name; a recycled pid keeps a stale directory until that process
exits too.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

from workers.contract import RUN_DIR_MARKER

RUN_DIR_PREFIX = "hetserve-"


def make_run_dir() -> Path:
    """A fresh private (0700) directory named after this router's pid, marked as ours."""
    path = Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-"))
    os.chmod(path, 0o700)
    (path / RUN_DIR_MARKER).write_text(f"hetserve router pid {os.getpid()}\n")
    return path


def _is_run_dir(d: Path) -> bool:
    """A real directory (not a link) of ours holding the marker file this router writes first."""
    try:
        st = d.lstat()
        marker = (d / RUN_DIR_MARKER).lstat()
    except OSError:
        return False
    uid = os.getuid()
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == uid
            and stat.S_ISREG(marker.st_mode) and marker.st_uid == uid)


def sweep_stale_run_dirs(tmp: Path | None = None, prefix: str = RUN_DIR_PREFIX) -> list[Path]:
    """Remove run directories left by routers that died without cleaning up (SIGKILL): named
    `hetserve-<pid>-*` (`prefix`: the host KV tier's name them alike, server/fleet/kv_tier_dir.py),
    holding the marker file, owned by this user, whose router pid is gone. Anything else with a
    matching name (another program's folder, a link) is left alone."""
    removed = []
    for d in Path(tmp or tempfile.gettempdir()).glob(f"{prefix}*-*"):
        pid = d.name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or not _is_run_dir(d):
            continue
        try:
            os.kill(int(pid), 0)
            continue  # that router is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed
