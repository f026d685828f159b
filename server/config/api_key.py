"""Where the API key comes from: `--api-key-file`, `--api-key` or `HETSERVE_API_KEY`.

A key on the command line is visible to every local user (`ps`, /proc/<pid>/cmdline), so the
key can also come from a file (`--api-key-file`, first line, surrounding whitespace dropped;
a file others can read gets a warning) or from the environment (`HETSERVE_API_KEY`, readable
only by the same user and root). At most one of the two options may be given; the
environment is read when neither is. The key never reaches the workers: they are spawned
without the variable. `resolve_api_key` returns the key with where it came from, for the log.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from server.errors import UsageError

logger = logging.getLogger(__name__)

ENV_API_KEY = "HETSERVE_API_KEY"


def _from_file(path_text: str) -> str:
    path = Path(path_text).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
        mode = path.stat().st_mode
    except OSError as e:
        raise UsageError(f"Cannot read `--api-key-file {path_text}`: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise UsageError(f"`--api-key-file {path_text}` is not UTF-8 text") from e
    key = (text.splitlines() or [""])[0].strip()
    if not key:
        raise UsageError(f"`--api-key-file {path_text}` is empty. Accepted: a file whose first line is the key")
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        logger.warning("API key file %s is readable by other users (mode %o); chmod 600 it", path, stat.S_IMODE(mode))
    return key


def resolve_api_key(flag: str | None, file: str | None, environ=None) -> tuple[str | None, str]:
    """(key or None, where it came from)."""
    environ = os.environ if environ is None else environ
    if flag and file:
        raise UsageError("Give the API key once: `--api-key` or `--api-key-file`, not both")
    if file:
        return _from_file(file), f"--api-key-file {file}"
    if flag:
        return flag, "--api-key"
    value = (environ.get(ENV_API_KEY) or "").strip()
    if value:
        return value, f"${ENV_API_KEY}"
    return None, "none"
