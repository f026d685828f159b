"""One Triton cache directory per architecture: `<root>/sm_89/`, `<root>/gfx942/`.

Triton keys its cache by source and target, but a directory shared by processes of
different architectures still mixes their binaries (and a stale or foreign entry is then
one environment variable away). So every worker compiles into a directory named after its
device's full architecture, and the router, which builds each worker's environment before
its Python starts, sets it there; a worker started by hand sets it itself right after
binding, before Triton is imported. Both read the root the same way: `HETSERVE_TRITON_CACHE`,
else the user's `TRITON_CACHE_DIR`, else Triton's own default (`~/.triton/cache`).
`hetserve plan --compile` compiles into the same directories, so a plan warms the workers'
caches. Torch-free: the router uses it.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

ENV_TRITON_CACHE = "HETSERVE_TRITON_CACHE"  # the root; each architecture gets a directory below it
ENV_TRITON_CACHE_DIR = "TRITON_CACHE_DIR"  # what Triton reads: set to <root>/<arch>


def triton_cache_root(env: MutableMapping[str, str] | None = None) -> Path:
    """The root every architecture's directory lives in."""
    env = os.environ if env is None else env
    root = env.get(ENV_TRITON_CACHE) or env.get(ENV_TRITON_CACHE_DIR)
    return Path(root) if root else Path.home() / ".triton" / "cache"


def triton_cache_dir(arch_name: str, env: MutableMapping[str, str] | None = None) -> Path:
    """`<root>/<arch>`: the Triton cache of the architecture `sm_89`, `gfx942`, `cpu`."""
    if not arch_name or os.sep in arch_name or arch_name.startswith("."):
        raise ValueError(f"Invalid architecture name `{arch_name}` for a cache directory (e.g. sm_89, gfx942)")
    return triton_cache_root(env) / arch_name


def use_triton_cache(arch_name: str, env: MutableMapping[str, str] | None = None) -> Path:
    """Point Triton at this architecture's directory (in `env`, default this process's
    environment): the root is kept in `HETSERVE_TRITON_CACHE`, the directory in
    `TRITON_CACHE_DIR`. Idempotent: a directory already set for this architecture stays."""
    env = os.environ if env is None else env
    current = env.get(ENV_TRITON_CACHE_DIR)
    if current and not env.get(ENV_TRITON_CACHE) and Path(current).name == arch_name:
        root = Path(current).parent  # already this architecture's directory (set by a router)
    else:
        root = triton_cache_root(env)
    env[ENV_TRITON_CACHE] = str(root)
    env[ENV_TRITON_CACHE_DIR] = str(root / arch_name)
    return root / arch_name
