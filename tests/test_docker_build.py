"""deploy/Dockerfile read by both builders: only syntax the classic builder knows, and a build
context (the root .dockerignore) that holds what the image copies and nothing else.

Debian's docker.io has no buildx, so the classic builder is all there is on such a host; BuildKit
reads the same file. tests/test_docker_compose.py builds it for real; these checks are offline.
"""

from __future__ import annotations

import fnmatch
import re

from deploy_tools import DEPLOY, DOCKERFILE, ROOT, dockerfile_instructions


def test_dockerfile_uses_only_syntax_both_builders_read():
    """The classic builder (the only one with Debian's docker.io, no buildx) refuses BuildKit's
    `COPY --chmod`, `RUN --mount`, heredocs and `# syntax=` frontends."""
    text = DOCKERFILE.read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I)
    allowed = {"COPY": {"from", "chown"}, "ADD": {"chown"}, "RUN": set()}
    for key, args in dockerfile_instructions():
        words = args.split()
        flags = {w[2:].split("=", 1)[0]
                 for w in words[: next(i for i, w in enumerate(words) if not w.startswith("--"))]}
        assert flags <= allowed.get(key, flags), (key, args)
        if key in allowed:
            assert "<<" not in args, (key, args)


def test_build_context_is_what_the_image_copies():
    """Both builders read the root .dockerignore; the classic builder knows no per-Dockerfile
    ignore file (it sent the whole repository, .venv included, with deploy/Dockerfile.dockerignore)
    and BuildKit would prefer one over the root file."""
    assert not (DEPLOY / "Dockerfile.dockerignore").exists()
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    rules = [(ln.startswith("!"), ln.lstrip("!").rstrip("/")) for ln in lines if ln.strip() and not ln.startswith("#")]

    def ignored(path: str) -> bool:  # the last rule matching the path or a parent decides
        parents = ["/".join(path.split("/")[: i + 1]) for i in range(path.count("/") + 1)]
        out = False
        for negate, pattern in rules:
            if any(fnmatch.fnmatchcase(p, pattern) for p in parents):
                out = not negate
        return out

    copied = [src for k, a in dockerfile_instructions() if k == "COPY" and "--from" not in a for src in a.split()[:-1]]
    assert "deploy/wheels" in copied
    for src in copied:
        assert not ignored(src) and not ignored(f"{src}/x.whl"), src
    for left_out in (".venv/bin/python", ".git/HEAD", "tests/test_deploy.py", "server/__pycache__/app.pyc"):
        assert ignored(left_out), left_out
