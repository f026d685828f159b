"""Structured output: a grammar per request, enforced token by token as a bitmask on the logits.

Design: llguidance is the engine (it reads the model's own `tokenizer.json`, needs no other
package, computes masks lazily in Rust with the GIL released, and refuses what it cannot enforce
with the reason, which becomes the 422). `Grammars` turns a request's `GrammarSpec` into a
`CompiledGrammar`, a matcher kept as a template in an LRU cache bounded by bytes (refusals cached
too), so a schema compiles once per worker and each request gets its own copy. Every compile is
first proven in a sandboxed child under a `CompileBudget` (workers/sampling/grammar_sandbox.py),
in pools of its own: every new grammar gets `FAST_LANE_S` in a fast lane, and one still compiling
then goes on in the budgeted pool, so an ordinary grammar never waits behind bombs. The sampler
fills one bitmask row per constrained sequence (`fill_bitmasks`) and sets disallowed logits to
-inf before temperature and truncation; JSON comes out compact. Trade-off: lazily computed masks
cost more per step than precomputed ones, and a grammar slower than the fast lane is built twice
(docs/benchmarks.md, "Structured output"; the budgets: docs/hardening.md)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import torch

from workers.contract import load_json_schema
from workers.sampling.grammar_sandbox import (
    BudgetExceeded,
    CompileBudget,
    CompileCancelled,
    CompileSandbox,
    SliceOver,
)
from workers.sampling.grammar_source import (
    KINDS,
    LIMITS,
    GrammarError,
    describe,
    engine_reason,
    grammar_source,
)

logger = logging.getLogger(__name__)

__all__ = ["KINDS", "BudgetExceeded", "CompileBudget", "CompileCancelled", "CompiledGrammar", "GrammarBusy",
           "GrammarError", "GrammarSpec", "Grammars", "advance", "apply_bitmask", "fill_bitmasks", "json_text"]

_REFUSAL_BYTES = 256  # what a cached refusal counts beyond its spec's text
FAST_LANE_S = 0.1  # a new grammar's first try; one that takes longer goes on in the budgeted pool
_SHIFTS = torch.arange(32, dtype=torch.int32)  # bit k of each 32-bit word of a bitmask row


class GrammarBusy(RuntimeError):
    """Every compile slot is taken and enough compiles wait already (HTTP 429)."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to.

    `json_schema`: `text` is the schema as JSON text; `json_object`: any JSON object (`text`
    unused); `regex`: `text` is the pattern the whole output must match; `choice`: `text` is a
    JSON list of strings, the output exactly one of them. A non-`strict` schema ignores
    keywords the engine does not implement instead of refusing them."""

    kind: str
    text: str = ""
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"Grammar type `{self.kind}` is not supported. Supported: {', '.join(KINDS)}")

    def source(self) -> str:
        """The llguidance grammar for this spec (raises `GrammarError` for a malformed one)."""
        return grammar_source(self.kind, self.text, self.strict)


class CompiledGrammar:
    """A compiled grammar: the initial matcher, copied for each request; `nbytes` is what it holds."""

    __slots__ = ("spec", "_template", "nbytes")

    def __init__(self, spec: GrammarSpec, template: llguidance.LLMatcher, nbytes: int = 0):
        self.spec, self._template, self.nbytes = spec, template, nbytes

    def matcher(self) -> llguidance.LLMatcher:
        return self._template.deep_copy()


class _ByteLRU:
    """Compiled grammars and refusals by spec, least recently used out first, at most
    `capacity` bytes (an entry larger than that is not kept). Thread-safe."""

    def __init__(self, capacity: int):
        self.capacity, self.nbytes = capacity, 0
        self._entries: OrderedDict[GrammarSpec, tuple[CompiledGrammar | GrammarError, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, spec: GrammarSpec) -> CompiledGrammar | GrammarError | None:
        with self._lock:
            hit = self._entries.get(spec)
            if hit is None:
                return None
            self._entries.move_to_end(spec)
            return hit[0]

    def put(self, spec: GrammarSpec, value: CompiledGrammar | GrammarError, nbytes: int) -> None:
        with self._lock:
            old = self._entries.pop(spec, None)
            if old is not None:
                self.nbytes -= old[1]
            if nbytes > self.capacity:
                return
            self._entries[spec] = (value, nbytes)
            self.nbytes += nbytes
            while self.nbytes > self.capacity:
                _, (_, freed) = self._entries.popitem(last=False)
                self.nbytes -= freed


@dataclass(eq=False)
class _Flight:
    """One compile under way and the requests waiting for it."""

    future: asyncio.Future
    cancel: threading.Event = field(default_factory=threading.Event)
    waiters: int = 0


class Grammars:
    """Compiles grammars for one tokenizer under a budget and caches them by bytes (see the
    module docstring). `compile` is thread-safe; `compile_async` belongs to one event loop."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...], threads: int = 1,
                 budget: CompileBudget | None = None):
        self.vocab_size, self.eos_token_ids = vocab_size, tuple(eos_token_ids)
        self.budget = budget or CompileBudget()
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids) or None)
        self.executor = llguidance.LLExecutor(num_threads=max(1, threads))
        self.sandbox = CompileSandbox(tokenizer_json, vocab_size, self.eos_token_ids, self.budget)
        self._cache = _ByteLRU(self.budget.cache_bytes)
        self._pools: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None = None  # (fast lane, budgeted pool)
        self._flights: dict[GrammarSpec, _Flight] = {}
        self.compiled = 0  # grammars compiled (cache misses), for tests and metrics

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int | None, eos_token_ids: tuple[int, ...], threads: int = 1,
                      budget: CompileBudget | None = None) -> Grammars:
        """From a `tokenizers.Tokenizer` (its JSON is what llguidance reads)."""
        size = vocab_size or tokenizer.get_vocab_size(with_added_tokens=True)
        return cls(tokenizer.to_str(), size, eos_token_ids, threads, budget)

    @property
    def cache_bytes(self) -> int:
        """Bytes the cached grammars hold now."""
        return self._cache.nbytes

    def cached(self, spec: GrammarSpec) -> CompiledGrammar | None:
        """The cached grammar for `spec` (None when not compiled yet); a cached refusal raises."""
        hit = self._cache.get(spec)
        if isinstance(hit, BudgetExceeded):
            raise BudgetExceeded(hit.budget, str(hit))  # a fresh one: a re-raised instance keeps its old traceback
        if isinstance(hit, GrammarError):
            raise GrammarError(str(hit))
        return hit

    def compile(self, spec: GrammarSpec, cancel: threading.Event | None = None,
                slice_s: float | None = None) -> CompiledGrammar:
        """The compiled grammar for `spec`, from the cache or compiled under the budget in this
        thread; `GrammarError` (or `BudgetExceeded`) names why it cannot be, `CompileCancelled`
        when `cancel` was set meanwhile, `SliceOver` when `slice_s` passed first."""
        hit = self.cached(spec)
        if hit is not None:
            return hit
        try:
            probe = self.sandbox.check(spec.kind, spec.text, spec.strict, cancel, slice_s)
            if probe.dead:
                raise GrammarError(f"The {describe(spec.kind)} allows no output: no token can start or continue it")
            template = llguidance.LLMatcher(self.tokenizer, spec.source(), log_level=0, limits=LIMITS)
            if template.is_error():
                raise GrammarError(f"The {describe(spec.kind)} cannot be enforced: "
                                   f"{engine_reason(template.get_error())}")
        except GrammarError as e:
            self._cache.put(spec, e, len(spec.text) + _REFUSAL_BYTES)
            raise
        compiled = CompiledGrammar(spec, template, probe.nbytes)
        self.compiled += 1
        self._cache.put(spec, compiled, probe.nbytes + len(spec.text))
        logger.debug("compiled %s grammar: %d bytes (%d cached, %d bytes)", spec.kind, probe.nbytes, len(self._cache),
                     self._cache.nbytes)
        return compiled

    async def compile_async(self, spec: GrammarSpec) -> CompiledGrammar:
        """`compile` in the grammar pool, off the event loop: one compile per spec however many
        requests wait for it, cancelled once every one of them was cancelled (its client left).
        `GrammarBusy` when the pool is full and `budget.max_waiting` compiles already wait."""
        hit = self.cached(spec)
        if hit is not None:
            return hit
        flight = self._flights.get(spec)
        if flight is None:
            if len(self._flights) >= self.budget.workers + self.budget.max_waiting:
                raise GrammarBusy(f"Worker busy compiling {len(self._flights)} grammars "
                                  f"({self.budget.workers} at once); retry later")
            cancel = threading.Event()
            future = asyncio.ensure_future(self._in_lanes(spec, cancel))
            flight = self._flights[spec] = _Flight(future, cancel)
            future.add_done_callback(lambda f, flight=flight: self._landed(spec, flight, f))
        flight.waiters += 1
        try:
            return await asyncio.shield(flight.future)
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.future.done():
                flight.cancel.set()  # nobody waits any more: kill the child, free the slot
                self._flights.pop(spec, None)

    async def _in_lanes(self, spec: GrammarSpec, cancel: threading.Event) -> CompiledGrammar:
        """The fast lane first (`FAST_LANE_S`), then, for a compile that takes longer, the
        budgeted pool (see the module docstring)."""
        loop = asyncio.get_running_loop()
        if self._pools is None:
            self._pools = (ThreadPoolExecutor(self.budget.workers, thread_name_prefix="grammar-fast"),
                           ThreadPoolExecutor(self.budget.workers, thread_name_prefix="grammar-compile"))
        fast, slow = self._pools
        if FAST_LANE_S < self.budget.timeout_s:
            try:
                return await loop.run_in_executor(fast, self.compile, spec, cancel, FAST_LANE_S)
            except SliceOver:
                logger.debug("%s grammar not compiled within %g s: on to the budgeted pool", spec.kind, FAST_LANE_S)
        return await loop.run_in_executor(slow, self.compile, spec, cancel)

    def _landed(self, spec: GrammarSpec, flight: _Flight, future: asyncio.Future) -> None:
        if self._flights.get(spec) is flight:
            self._flights.pop(spec)
        if not future.cancelled():
            future.exception()  # retrieved: a cancelled compile's `CompileCancelled` is nobody's to log

    def close(self) -> None:
        """Stop the compile children and the pool (the worker is shutting down)."""
        self.sandbox.close()
        for pool in self._pools or ():
            pool.shutdown(wait=False, cancel_futures=True)


def json_text(value) -> str:
    """A schema given as an object or as JSON text -> compact JSON text (the cache key). Keys keep
    their order: properties are generated in the order the schema lists them."""
    try:
        value = load_json_schema(value, "The JSON schema")
    except ValueError as e:
        raise GrammarError(str(e)) from e
    return json.dumps(value, separators=(",", ":"))


def fill_bitmasks(executor: llguidance.LLExecutor, matchers: list[tuple[llguidance.LLMatcher, int]],
                  num_rows: int, vocab_size: int) -> torch.Tensor:
    """Allowed-token bitmasks `[num_rows, ceil(V / 32)]` int32 for the given (matcher, row)
    pairs, in one parallel call; rows without a matcher stay all-allowed."""
    bitmask = torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), bitmask.shape[1] * 4, num_rows)
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                  fallback_ids: tuple[int, ...]) -> torch.Tensor:
    """Set the logits of tokens a row's bitmask disallows to -inf, in place, on the logits'
    device. A row whose mask allows nothing (a matcher in an error state) allows
    `fallback_ids` (EOS), so it ends."""
    device = logits.device
    index = torch.tensor(rows, dtype=torch.int64, device=device)
    words = bitmask.index_select(0, torch.tensor(rows, dtype=torch.int64)).to(device, non_blocking=True)  # [R, W]
    allowed = ((words[:, :, None] >> _SHIFTS.to(device)) & 1).bool().flatten(1)[:, : logits.shape[1]]  # [R, V]
    if fallback_ids:
        empty = ~allowed.any(dim=1, keepdim=True)  # [R, 1]
        fallback = torch.zeros_like(allowed)
        fallback[:, torch.tensor(fallback_ids, device=device)] = True
        allowed |= empty & fallback
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits


def advance(matcher: llguidance.LLMatcher, token_id: int) -> bool:
    """Feed the sampled token; True when the grammar is complete (nothing but EOS may follow)."""
    if not matcher.consume_token(token_id):
        logger.warning("grammar refused token %s: %s", token_id, matcher.get_error())
        return True
    return matcher.is_stopped()
