"""What one request may cost: the grammar compile budget the workers enforce, and the router's
write timeout for clients that stop reading.

The router validates these flags once and writes the grammar ones into every worker's
configuration (`worker_budget`: the `WorkerConfig` fields, workers/contract/config.py, whose
defaults both read from workers/contract/limits.py); the write timeout is the router's own
(server/edge/http11.py). Trade-off: the router's messages name its own flags, and the worker
checks the values again when it reads its configuration.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from server.errors import UsageError
from workers.contract.limits import (
    GRAMMAR_CACHE_MIB,
    GRAMMAR_COMPILE_MEMORY_MIB,
    GRAMMAR_COMPILE_TIMEOUT_S,
    GRAMMAR_COMPILE_WORKERS,
)

WRITE_TIMEOUT_S = 30.0  # a client that reads nothing of its answer for this long is cut off


@dataclass(frozen=True)
class RequestBudgets:
    write_timeout_s: float = WRITE_TIMEOUT_S  # --write-timeout
    grammar_compile_timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S  # --grammar-compile-timeout
    grammar_compile_memory_mib: int = GRAMMAR_COMPILE_MEMORY_MIB  # --grammar-compile-memory-mib
    grammar_compile_workers: int = GRAMMAR_COMPILE_WORKERS  # --grammar-compile-workers
    grammar_cache_mib: int = GRAMMAR_CACHE_MIB  # --grammar-cache-mib


# flag -> (field, type, smallest accepted, strict bound)
_FLAGS = {
    "write_timeout": ("write_timeout_s", float, 0, True),
    "grammar_compile_timeout": ("grammar_compile_timeout_s", float, 0, True),
    "grammar_compile_memory_mib": ("grammar_compile_memory_mib", int, 1, False),
    "grammar_compile_workers": ("grammar_compile_workers", int, 1, False),
    "grammar_cache_mib": ("grammar_cache_mib", int, 0, False),
}


def add_budget_flags(serve: argparse.ArgumentParser) -> None:
    d = RequestBudgets()
    g = serve.add_argument_group("budgets", "what one request may cost")
    g.add_argument("--write-timeout", type=float, default=None, metavar="S",
                   help=f"seconds a client may read nothing of its answer before the connection is cut and its "
                        f"request cancelled (default {d.write_timeout_s:g})")
    g.add_argument("--grammar-compile-timeout", type=float, default=None, metavar="S",
                   help=f"wall-clock seconds one grammar (JSON schema, regex, tools, choice) may take to compile; "
                        f"over it the request is a 422 (default {d.grammar_compile_timeout_s:g})")
    g.add_argument("--grammar-compile-memory-mib", type=int, default=None, metavar="N",
                   help=f"MiB one grammar compile may use, in its own process; over it the request is a 422 "
                        f"(default {d.grammar_compile_memory_mib})")
    g.add_argument("--grammar-compile-workers", type=int, default=None, metavar="N",
                   help=f"grammar compiles one worker runs at once (default {d.grammar_compile_workers})")
    g.add_argument("--grammar-cache-mib", type=int, default=None, metavar="N",
                   help=f"MiB of compiled grammars one worker keeps (default {d.grammar_cache_mib})")


def budgets_from_args(args) -> RequestBudgets:
    """The budget flags that were given, checked (`UsageError` names the bad one)."""
    given = {}
    for flag, (name, _kind, low, strict) in _FLAGS.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        if value < low or (strict and value == low):
            raise UsageError(f"`--{flag.replace('_', '-')} {value}` must be {'>' if strict else '>='} {low}")
        given[name] = value
    return RequestBudgets(**given)


def worker_budget(budgets: RequestBudgets) -> dict:
    """The grammar budget as the `WorkerConfig` fields that carry it to a worker."""
    return {"grammar_compile_timeout": budgets.grammar_compile_timeout_s,
            "grammar_compile_memory_mib": budgets.grammar_compile_memory_mib,
            "grammar_compile_workers": budgets.grammar_compile_workers,
            "grammar_cache_mib": budgets.grammar_cache_mib}
