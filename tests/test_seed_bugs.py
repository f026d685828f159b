"""Each seed bug of the device-safety core, re-introduced into a copy of the package, makes its
targeted tests fail (tests/seed_bugs.py has the table and the runner); the unpatched copy passes
them all. A later edit that weakens a guard's test fails here even when no mutation run is made.

The runner is one child interpreter (a fresh one: the suite's own process has already imported
hetserve), about 20-40 s on the 2-core CI machine for all bugs together."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.seed_bugs import ROOT, SEED_BUGS, SEEDS, PatchError, SeedBug, apply, make_copy


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("seed-bugs") / "results.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "seed_bugs.py"), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=420,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())["results"]


def test_every_seed_has_at_least_two_bugs():
    per_seed = Counter(b.seed for b in SEED_BUGS)
    assert set(per_seed) == set(SEEDS) and min(per_seed.values()) >= 2, per_seed
    assert len({b.name for b in SEED_BUGS}) == len(SEED_BUGS)


def test_the_unpatched_copy_passes_every_targeted_test(results):
    """The baseline: a failure below comes from the patch, not from the copy."""
    clean = results["clean"]
    assert clean["exit_code"] == 0, clean["log_tail"]
    assert " passed" in clean["summary"] and "failed" not in clean["summary"]


@pytest.mark.parametrize("bug", SEED_BUGS, ids=lambda b: b.name)
def test_the_seed_bug_makes_its_tests_fail(results, bug: SeedBug):
    r = results[bug.name]
    assert r["error"] is None, r["error"]
    # pytest exit code 1: tests ran and failed (not a collection or usage error)
    assert r["exit_code"] == 1, f"{bug.path}: `{bug.new.strip()}` left {bug.tests} passing: {r['summary']}"
    assert " failed" in r["summary"], r["log_tail"]


def test_a_guarding_line_that_moved_is_reported(tmp_path: Path):
    bug = SEED_BUGS[0]
    root = make_copy(tmp_path)
    apply(bug, root)
    assert bug.new in (root / bug.path).read_text()
    with pytest.raises(PatchError, match=f"`{bug.name}`: its guarding text occurs 0 times in `{bug.path}`"):
        apply(bug, root)
