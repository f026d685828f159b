#!/usr/bin/env bash
# Mutation testing of the device-safety core, in one command. Run it by hand, not in CI: about 1,100
# mutants; on the 2 shared cores here the first 700 took 15 minutes, the rest (the functions every
# test reaches) longer.
#
# Tool: mutmut (3.x), not cosmic-ray. mutmut rewrites each function once with a switch to all its
# mutants and forks every mutant from one warm process, so torch, `kernels` and the test modules
# are imported once, not once per mutant; and it records which tests reach each function, so a
# mutant runs only the tests that cover it (cosmic-ray starts the test command afresh for every
# mutant: several seconds of imports each, over a thousand mutants, hours on this machine). The
# price: mutmut mutates inside functions only, and a function that runs only at import time (the
# kernel mapping's table) is never switched to a mutant; the seed-bug tests
# (tests/test_seed_bugs.py) patch such lines in a copy of the package instead.
#
# What is mutated and which tests run: `[tool.mutmut]` in pyproject.toml, narrowed to the safety
# core by scripts/mutation.py. Survivors must be listed, with the fingerprint of their diff and
# one line on why, in scripts/mutation_equivalents.txt; any other survivor fails the run.
#
#   scripts/mutation.sh                      run, score, compare with the equivalents file
#   scripts/mutation.sh --report-only        re-read the last run (.cache/mutation/)
#   scripts/mutation.sh --candidates F       also write the unexplained survivors as lines for the file
#   scripts/mutation.sh --tests-from main    score another revision's tests against this code
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/bootstrap.sh" dev
cd "$root"
MUTMUT_VERSION="3.8.1"
if [ "$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("mutmut"))' 2>/dev/null)" != "$MUTMUT_VERSION" ]; then
  echo "[mutation] installing mutmut==$MUTMUT_VERSION" >&2
  .venv/bin/python -m pip install -q "mutmut==$MUTMUT_VERSION"
fi
exec .venv/bin/python scripts/mutation.py "$@"
