"""Mutation testing of the device-safety core: run mutmut, then hold its survivors against the
committed list of explained ones (scripts/mutation_equivalents.txt). Run through
scripts/mutation.sh, which installs the pinned mutmut first.

Design: the working tree (tracked and untracked, not ignored files) is copied to
`.cache/mutation/`, where mutmut writes its `mutants/` tree, so a run never touches the sources
and always starts fresh. mutmut's configuration (which files, which tests, fork server) is
`[tool.mutmut]` in pyproject.toml; `SAFETY_CORE` below narrows server/routing/filter.py to its routing
constraints (pinned worker, minimum capability, fp8 convention). A mutant that survives is
*explained* when the equivalents file lists its name with the fingerprint of its diff and one
line on why; a listed name whose diff changed (its function was edited, so mutmut renumbered)
no longer matches, so the survivor shows as new and must be looked at again. The trade-off:
renumbering after an edit asks for a re-review of that function's listed mutants, which is the
point. Reads mutmut's result files and diff helper (pinned version).

Exit status: 0 when every survivor is explained, 1 otherwise (each new one printed with its diff).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGE = ROOT / ".cache" / "mutation"
EQUIVALENTS = ROOT / "scripts" / "mutation_equivalents.txt"

# mutmut names mutants `<module>.x_<function>__mutmut_<n>` and `<module>.xǁ<Class>ǁ<method>__mutmut_<n>`.
SAFETY_CORE = (
    "workers.device.bind.*",
    "workers.device.guard.*",
    "workers.quant.fp8_convention.*",
    # the e4m3 formats and exact rounding (the module's checkpoint arithmetic is not in the core)
    "workers.quant.e4m3.xǁE4M3Formatǁ*",
    "workers.quant.e4m3.x_round_to_e4m3__mutmut_*",
    "workers.quant.e4m3.x_encode_e4m3__mutmut_*",
    "workers.quant.e4m3.x__decode_table__mutmut_*",
    "workers.quant.e4m3.x_decode_e4m3__mutmut_*",
    "workers.quant.fp8_quantize.*",
    "workers.kernelize.apply.*",
    "workers.kernelize.crosscheck.*",
    "workers.contract.fp8_rule.*",
    "workers.contract.capability.*",
    "kernels_local.mapping.*",
    # the repository's e4m3 helpers; its Triton launch wrapper runs only under the interpreter, in
    # the child process of tests/test_kernels_triton.py, where no mutant can be switched on
    "kernels_local.fp8_linear.quant.x_get_format__mutmut_*",
    "kernels_local.fp8_linear.quant.x_round_to_grid__mutmut_*",
    "kernels_local.fp8_linear.quant.x_quantize_rows__mutmut_*",
    "kernels_local.fp8_linear.quant.x_decode__mutmut_*",
    # routing constraints only: pinned worker, minimum capability, fp8 convention
    "server.routing.filter.xǁConstraintsǁ*",
    "server.routing.filter.x_parse_capability__mutmut_*",
    "server.routing.filter.x_parse_constraints__mutmut_*",
    "server.routing.filter.x_matches__mutmut_*",
)
DETECTED = ("killed", "timeout", "caught by type check")


@dataclass(frozen=True)
class Listed:
    name: str
    fingerprint: str
    why: str


def stage() -> None:
    """A fresh copy of the working tree in STAGE (the venv and caches stay behind)."""
    shutil.rmtree(STAGE, ignore_errors=True)
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (STAGE / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, STAGE / rel)


def use_tests_from(ref: str) -> None:
    """Replace the staged tests/ by those of git `ref` (to score an older test suite against the
    same code), dropping test files it lacks from the staged mutmut configuration."""
    shutil.rmtree(STAGE / "tests")
    archive = subprocess.run(["git", "archive", ref, "tests"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(STAGE)], input=archive, check=True)
    config = STAGE / "pyproject.toml"
    kept = [
        line for line in config.read_text().splitlines(keepends=True)
        if not (line.strip().startswith('"tests/') and not (STAGE / line.strip().strip('",')).exists())
    ]  # fmt: skip
    config.write_text("".join(kept))


def run_mutmut(jobs: int) -> None:
    log = STAGE / "mutmut.log"
    print(f"mutmut: {len(SAFETY_CORE)} name patterns, {jobs} workers; progress in {log}", flush=True)
    with open(log, "w") as out:
        subprocess.run(
            [sys.executable, "-m", "mutmut", "run", "--max-children", str(jobs), *SAFETY_CORE],
            cwd=STAGE, stdout=out, stderr=subprocess.STDOUT, check=False,
        )  # fmt: skip


def statuses() -> dict[str, str]:
    """{mutant name: mutmut status} for the safety core, read from mutmut's result files."""
    from mutmut.stats import status_by_exit_code

    found = {}
    for meta in (STAGE / "mutants").rglob("*.py.meta"):
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            if any(fnmatch.fnmatchcase(name, p) for p in SAFETY_CORE):
                found[name] = status_by_exit_code[code]
    return found


def diff_of(name: str) -> str:
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    module = name.partition("__mutmut_")[0].rpartition(".")[0]
    return get_diff_for_mutant(name, path=Path(*module.split(".")).with_suffix(".py"))


def fingerprint(diff: str) -> str:
    """Hash of the changed lines only (not the hunk positions)."""
    changed = [ln for ln in diff.splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    return hashlib.sha256("\n".join(changed).encode()).hexdigest()[:10]


def read_equivalents(path: Path = EQUIVALENTS) -> dict[str, Listed]:
    """`<mutant name> <fingerprint> <why>` per line; `#` starts a comment line."""
    listed = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.split(maxsplit=2)
        if len(parts) < 3:
            raise SystemExit(f"{path.name}:{n}: expected `<mutant> <fingerprint> <why>`, got `{line}`")
        listed[parts[0]] = Listed(*parts)
    return listed


def report(found: dict[str, str], listed: dict[str, Listed], candidates: Path | None) -> int:
    counts = Counter(found.values())
    total = len(found)
    detected = sum(counts[s] for s in DETECTED)
    unchecked = sorted(n for n, s in found.items() if s == "not checked")  # an interrupted run
    survivors = sorted(n for n, s in found.items() if s not in DETECTED and s != "not checked")
    os.chdir(STAGE)  # mutmut's helpers read `mutants/` and pyproject.toml from the working directory
    explained, new, lines = [], [], []
    for name in survivors:
        diff = diff_of(name)
        fp = fingerprint(diff)
        entry = listed.get(name)
        if entry is not None and entry.fingerprint == fp:
            explained.append(name)
        else:
            new.append((name, found[name], diff))
            lines.append(f"{name} {fp} TODO ({found[name]})")
    stale = sorted(set(listed) - set(explained) - set(unchecked))
    print(f"\nmutants of the safety core: {total}; " + ", ".join(f"{s} {c}" for s, c in counts.most_common()))
    checked = total - len(unchecked)
    if checked:
        print(f"score: {detected}/{checked} = {detected / checked:.1%} detected by the tests; "
              f"{len(explained)} explained in {EQUIVALENTS.relative_to(ROOT)}; {len(new)} unexplained")  # fmt: skip
    if unchecked:
        print(f"the run did not finish: {len(unchecked)} mutants not checked "
              f"({', '.join(sorted({n.partition('__mutmut_')[0] for n in unchecked}))})")  # fmt: skip
    for name in stale:
        print(f"stale entry (no longer a survivor with that diff): {name}")
    for name, status, diff in new:
        print(f"\nNEW {status}: {name}\n{diff}")
    if candidates is not None:
        candidates.write_text("\n".join(lines) + ("\n" if lines else ""))
        print(f"\n{len(lines)} candidate lines written to {candidates}")
    return 1 if new or unchecked or not total else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="mutants tested at once")
    p.add_argument("--report-only", action="store_true", help="re-read the last run's results")
    p.add_argument("--candidates", type=Path, help="write unexplained survivors as equivalents-file lines")
    p.add_argument("--tests-from", metavar="REF", help="score the tests of git REF instead (same code)")
    args = p.parse_args(argv)
    started = time.monotonic()
    if not args.report_only:
        stage()
        if args.tests_from:
            use_tests_from(args.tests_from)
        run_mutmut(args.jobs)
        print(f"mutmut finished in {time.monotonic() - started:.0f} s")
    return report(statuses(), read_equivalents(), args.candidates and args.candidates.resolve())


if __name__ == "__main__":
    sys.exit(main())
