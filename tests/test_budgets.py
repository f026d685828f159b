"""The budget flags: checked once by the router, passed to its workers, checked again there.

`hetserve serve` validates `--write-timeout` and the grammar compile budget
(server/config/budgets.py) and writes the grammar ones into each worker's configuration
(`WorkerConfig`, whose defaults are the workers' own: workers/contract/limits.py); the worker's
own command line (workers/main.py) refuses a bad value by name too.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from server.cli import build_parser
from server.config.budgets import RequestBudgets, budgets_from_args, worker_budget
from server.errors import UsageError
from tests.router_harness import ROOT
from workers.contract import WorkerConfig
from workers.main import parse_args
from workers.sampling.grammar_sandbox import CompileBudget


def serve_args(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_no_flag_means_the_defaults_and_nothing_for_the_workers():
    budgets = budgets_from_args(serve_args())
    assert budgets == RequestBudgets()
    assert WorkerConfig(socket="/tmp/x.sock", **worker_budget(budgets)) == WorkerConfig(socket="/tmp/x.sock")


def test_only_the_grammar_flags_that_differ_reach_the_workers():
    budgets = budgets_from_args(serve_args("--grammar-compile-timeout", "0.5", "--grammar-cache-mib", "8",
                                           "--write-timeout", "3", "--grammar-compile-workers", "2"))
    assert budgets.write_timeout_s == 3 and budgets.grammar_compile_timeout_s == 0.5
    config = WorkerConfig(socket="/tmp/x.sock", **worker_budget(budgets))
    assert [flag for flag in config.to_argv() if flag.startswith("--grammar")] == ["--grammar-compile-timeout",
                                                                                 "--grammar-cache-mib"]
    worker = CompileBudget.from_config(parse_args(config.to_argv()))
    assert worker.timeout_s == 0.5 and worker.cache_bytes == 8 << 20 and worker.workers == 2


@pytest.mark.parametrize("flags, needle", [
    (("--write-timeout", "0"), "`--write-timeout 0.0` must be > 0"),
    (("--grammar-compile-timeout", "-1"), "`--grammar-compile-timeout -1.0` must be > 0"),
    (("--grammar-compile-memory-mib", "0"), "`--grammar-compile-memory-mib 0` must be >= 1"),
    (("--grammar-compile-workers", "0"), "`--grammar-compile-workers 0` must be >= 1"),
    (("--grammar-cache-mib", "-2"), "`--grammar-cache-mib -2` must be >= 0"),
])
def test_the_router_refuses_a_bad_budget_by_name(flags, needle):
    with pytest.raises(UsageError) as e:
        budgets_from_args(serve_args(*flags))
    assert needle in str(e.value)


def test_hetserve_serve_exits_with_the_bad_flag_named():
    done = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--grammar-compile-timeout", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "`--grammar-compile-timeout 0.0` must be > 0" in done.stderr, done.stderr


@pytest.mark.parametrize("flags, needle", [
    (("--grammar-compile-workers", "0"), "`--grammar-compile-workers 0` must be at least 1"),
    (("--grammar-compile-timeout", "0"), "`--grammar-compile-timeout 0.0` must be > 0"),
    (("--grammar-cache-mib", "-1"), "`--grammar-cache-mib -1` must be >= 0"),
])
def test_the_worker_refuses_a_bad_budget_by_name(flags, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--socket", "/tmp/x.sock", *flags])
    assert e.value.code == 2 and needle in capsys.readouterr().err
