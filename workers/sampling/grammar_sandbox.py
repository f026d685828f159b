"""Grammar compiles under a budget: each new grammar is first built in a child process that can
be killed.

Why: llguidance builds a grammar in Rust with the GIL released, which nothing in this process can
interrupt, and its own limits do not bound every path (docs/hardening.md, "Grammar compiles").
Design: `CompileSandbox.check(spec)` sends the spec to a long-lived child
(workers/sampling/grammar_child.py, which holds the tokenizer) and waits at most
`CompileBudget.timeout_s`; over time the child is killed, over memory it aborts, either a
`BudgetExceeded` (a 422) after which the next compile starts a new child. A grammar that passes
comes back with the bytes its matcher holds and whether it allows any output; only then does the
worker build it. A compile whose clients all left is cancelled within `_POLL_S`; a fast-lane try
that runs out is a `SliceOver`, not a refusal. Each compiling thread owns one child, so the pool's
size bounds the children. Trade-off: a new grammar is built twice plus a pipe round trip; a cached
one costs nothing more (docs/benchmarks.md, "Structured output")."""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from workers.contract import WorkerConfig
from workers.contract.limits import (
    GRAMMAR_CACHE_MIB,
    GRAMMAR_COMPILE_MEMORY_MIB,
    GRAMMAR_COMPILE_TIMEOUT_S,
    GRAMMAR_COMPILE_WORKERS,
    grammar_budget_error,
)
from workers.sampling.grammar_child import read_frame, write_frame
from workers.sampling.grammar_source import GrammarError, describe

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a waiting compile looks at its cancel flag
_EXIT_WAIT_S = 1.0  # how long a child that closed its pipe may take to exit
_DIED = {"died": True}  # what `_Child.ask` answers when the child ended without answering
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # where `workers` is importable from
_CHILD = (sys.executable, "-m", "workers.sampling.grammar_child")


@dataclass(frozen=True)
class CompileBudget:
    """What one grammar compile may take, and what the worker keeps of compiled grammars."""

    timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S  # wall clock of one compile (--grammar-compile-timeout)
    memory_bytes: int = GRAMMAR_COMPILE_MEMORY_MIB << 20  # memory of one compile (--grammar-compile-memory-mib)
    workers: int = GRAMMAR_COMPILE_WORKERS  # compiles at once (--grammar-compile-workers)
    cache_bytes: int = GRAMMAR_CACHE_MIB << 20  # compiled grammars kept (--grammar-cache-mib)

    def __post_init__(self) -> None:
        error = grammar_budget_error(self.timeout_s, self.memory_bytes >> 20, self.workers, self.cache_bytes >> 20)
        if error is not None:
            raise ValueError(error)

    @classmethod
    def from_config(cls, config: WorkerConfig) -> CompileBudget:
        """The budget of the worker's configuration (its four `grammar_*` fields, checked there)."""
        return cls(timeout_s=config.grammar_compile_timeout, memory_bytes=config.grammar_compile_memory_mib << 20,
                   workers=config.grammar_compile_workers, cache_bytes=config.grammar_cache_mib << 20)

    @property
    def max_waiting(self) -> int:
        """Compiles that may wait for a free child; beyond it a new one is refused (429)."""
        return 4 * self.workers


class BudgetExceeded(GrammarError):
    """A compile that went over its time or memory budget (HTTP 422 naming the budget)."""

    def __init__(self, budget: str, message: str):
        super().__init__(message)
        self.budget = budget


class CompileCancelled(Exception):
    """Every request waiting for this compile has left; the child was killed."""


class SliceOver(Exception):
    """A compile that did not finish within its fast-lane slice; the child was killed, and the
    compile goes on in the budgeted pool."""


@dataclass(frozen=True)
class Probe:
    """What the sandboxed build found: the bytes the matcher holds, and whether it allows no output."""

    nbytes: int
    dead: bool


class _Child:
    """One compile child and its pipes; `kill()` when it is stuck or no longer wanted."""

    def __init__(self, header: dict, timeout_s: float):
        path = os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "RUST_BACKTRACE": "0", "PYTHONPATH": path}
        self.proc = subprocess.Popen(_CHILD, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        write_frame(self.proc.stdin, header)
        if self._wait(time.monotonic() + max(30.0, timeout_s), None) is None:
            self.kill()
            raise RuntimeError(f"the grammar compile child did not start (exit {self.proc.poll()})")

    def ask(self, request: dict, deadline: float, cancel: threading.Event | None) -> dict | None:
        """The child's answer; `_DIED` when it ended without one (its pipe closed), None when
        the deadline passed or `cancel` was set."""
        try:
            write_frame(self.proc.stdin, request)
        except OSError:
            return _DIED
        return self._wait(deadline, cancel)

    def _wait(self, deadline: float, cancel: threading.Event | None) -> dict | None:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or (cancel is not None and cancel.is_set()):
                return None
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, _POLL_S))
            if ready:
                try:
                    answer = read_frame(self.proc.stdout)
                except (OSError, ValueError):
                    answer = None
                return _DIED if answer is None else answer

    def exit_code(self) -> int | None:
        """How the child ended, once it has (it closed its pipe: the exit follows at once)."""
        try:
            return self.proc.wait(timeout=_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class CompileSandbox:
    """Sandboxed compiles for one tokenizer (see the module docstring); thread-safe."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...], budget: CompileBudget):
        self.budget = budget
        self._header = {"tokenizer": tokenizer_json, "vocab_size": vocab_size, "eos": list(eos_token_ids)}
        self._local = threading.local()
        self._children: set[_Child] = set()
        self._lock = threading.Lock()
        self.killed = 0  # children killed over budget or cancelled (tests, logs)
        self.sliced = 0  # children killed at the end of a fast-lane slice

    def check(self, kind: str, text: str, strict: bool, cancel: threading.Event | None = None,
              slice_s: float | None = None) -> Probe:
        """Build the grammar in this thread's child under the budget; `BudgetExceeded`,
        `GrammarError` (the engine's reason) or `CompileCancelled`. `slice_s`: give up after
        that long instead (`SliceOver`, not a refusal: the fast lane of workers/sampling/grammar.py)."""
        child = self._child()
        b = self.budget
        started = time.monotonic()
        answer = child.ask({"kind": kind, "text": text, "strict": strict, "memory_bytes": b.memory_bytes},
                           started + (b.timeout_s if slice_s is None else min(slice_s, b.timeout_s)), cancel)
        if answer is _DIED:  # the build ended the child: an allocation past the cap aborts it (SIGABRT)
            code = child.exit_code()
            self._drop(child)
            if code == -signal.SIGABRT:
                raise self._over_memory()
            logger.warning("grammar compile child ended without an answer (exit %s)", code)
            raise GrammarError(f"The {describe(kind)} made the grammar compiler fail (exit {code}). Accepted: a "
                               "grammar that compiles (a simpler schema or pattern)")
        if answer is None:
            if cancel is not None and cancel.is_set():
                self._drop(child)
                raise CompileCancelled("every request waiting for this grammar has left")
            if slice_s is not None and slice_s < b.timeout_s:
                self._drop(child, sliced=True)
                raise SliceOver(f"not compiled within the fast lane's {slice_s:g} s")
            self._drop(child)
            logger.warning("grammar compile over its %.3g s budget after %.2f s; child killed", b.timeout_s,
                           time.monotonic() - started)
            raise BudgetExceeded("time", f"The grammar did not compile within its time budget of {b.timeout_s:g} s "
                                         "(--grammar-compile-timeout). Accepted: a grammar that compiles within it "
                                         "(a simpler schema or pattern)")
        if answer.get("budget") == "memory":
            self._drop(child)
            raise self._over_memory()
        if not answer.get("ok"):
            raise GrammarError(answer.get("error") or "The grammar cannot be enforced")
        return Probe(int(answer.get("bytes") or 0), bool(answer.get("dead")))

    def _over_memory(self) -> BudgetExceeded:
        mib = self.budget.memory_bytes >> 20
        logger.warning("grammar compile over its %d MiB memory budget; child gone", mib)
        return BudgetExceeded("memory", f"The grammar needs more than its memory budget of {mib} MiB to compile "
                                        "(--grammar-compile-memory-mib). Accepted: a grammar that compiles within "
                                        "it (a simpler schema or pattern)")

    def _child(self) -> _Child:
        child = getattr(self._local, "child", None)
        if child is None or child.proc.poll() is not None:
            child = _Child(self._header, self.budget.timeout_s)
            self._local.child = child
            with self._lock:
                self._children.add(child)
        return child

    def _drop(self, child: _Child, sliced: bool = False) -> None:
        child.kill()
        if sliced:
            self.sliced += 1
        else:
            self.killed += 1
        self._local.child = None
        with self._lock:
            self._children.discard(child)

    def close(self) -> None:
        """Stop every child (the worker is shutting down)."""
        with self._lock:
            children, self._children = list(self._children), set()
        for child in children:
            child.kill()
