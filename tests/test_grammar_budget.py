"""The grammar compile budget, in process: the sandboxed child, the pool, the byte-bounded cache.

Each test builds real grammars with llguidance over the embedded model's tokenizer, in real
compile children (workers/sampling/grammar_sandbox.py). The bomb is the issue's: an `allOf`
of N `{"type": "string", "pattern": ".*X.*"}` whose compile is exponential in N (N=16 takes
seconds here, N=19 asks for hundreds of MiB), run with a small N and a tight budget so that
each test takes about a second. The end-to-end versions (through the router and a real
worker) are in tests/test_hardening.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from tokenizers import Tokenizer

from workers.contract import DEFAULT_MODEL_DIR
from workers.sampling.grammar import (
    BudgetExceeded,
    CompileBudget,
    GrammarBusy,
    GrammarError,
    Grammars,
    GrammarSpec,
)

EOS = (2,)


def bomb(n: int) -> str:
    """An `allOf` of `.*X.*` patterns. On the 2-core machine, unloaded, llguidance gives up on
    its own after 0.18 s (N=14), 0.72 s (16) and 1.87 s (17) ("Unable to determine if regex is
    empty"), and N=18 asks for more than 512 MiB: a time budget is only exercised when it is
    well under the engine's own give-up time, so the time tests use N=17 against 0.4-0.5 s."""
    return json.dumps({"allOf": [{"type": "string", "pattern": f".*{chr(65 + i)}.*"} for i in range(n)]})


def enum(size: int, tag: str) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps({"enum": [f"{tag}_{i}" for i in range(size)]}))


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))


def grammars_for(tokenizer, **budget) -> Grammars:
    return Grammars.for_tokenizer(tokenizer, tokenizer.get_vocab_size(), EOS, budget=CompileBudget(**budget))


def test_a_compile_over_its_time_budget_is_refused_naming_it(tokenizer):
    """Guards the deadline in `CompileSandbox.check` (a bomb of N=19 compiled for 8.6 s,
    N=21 for minutes, with nothing to stop it)."""
    g = grammars_for(tokenizer, timeout_s=0.4)
    try:
        t0 = time.monotonic()
        with pytest.raises(BudgetExceeded, match="time budget of 0.4 s") as e:
            g.compile(GrammarSpec("json_schema", bomb(17)))
        assert e.value.budget == "time" and time.monotonic() - t0 < 2.5
        assert g.sandbox.killed == 1
        ok = g.compile(GrammarSpec("json_schema", '{"type": "integer"}'))  # a fresh child serves the next
        assert ok.nbytes > 0
        t0 = time.monotonic()
        with pytest.raises(BudgetExceeded):  # the refusal is cached: not compiled again
            g.compile(GrammarSpec("json_schema", bomb(17)))
        assert time.monotonic() - t0 < 0.1 and g.sandbox.killed == 1
    finally:
        g.close()


def test_a_compile_over_its_memory_budget_is_refused_naming_it(tokenizer):
    """Guards RLIMIT_DATA in `grammar_child.build` and the SIGABRT reading in
    `CompileSandbox.check` (a bomb of N=21 asked for 7.7 GB at once and a worker under a
    memory limit was killed; a child that died of it was reported as over its time budget)."""
    g = grammars_for(tokenizer, timeout_s=60, memory_bytes=64 << 20)
    try:
        t0 = time.monotonic()
        with pytest.raises(BudgetExceeded, match="memory budget of 64 MiB") as e:
            g.compile(GrammarSpec("json_schema", bomb(20)))
        assert e.value.budget == "memory", str(e.value)
        assert time.monotonic() - t0 < 30
        with pytest.raises(BudgetExceeded, match="memory budget") as e:  # a megabyte regex of open groups
            g.compile(GrammarSpec("regex", "(" * 1_000_000))
        assert e.value.budget == "memory", str(e.value)
        assert g.compile(GrammarSpec("regex", "[0-9]+")).nbytes > 0
    finally:
        g.close()


def test_a_compile_whose_clients_all_left_is_cancelled(tokenizer):
    """Guards `flight.cancel.set()` in `Grammars.compile_async` (a client that left after
    1 s still cost the full compile, holding a pool thread)."""
    g = grammars_for(tokenizer, timeout_s=60)

    async def leave_after(s: float) -> float:
        task = asyncio.ensure_future(g.compile_async(GrammarSpec("json_schema", bomb(18))))
        await asyncio.sleep(s)
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while g.sandbox.killed == 0 and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.01)
        return time.monotonic() - t0

    try:
        assert asyncio.run(leave_after(0.5)) < 1.0  # the child is killed within a poll
        assert g.sandbox.killed == 1 and not g._flights
        assert g.cached(GrammarSpec("json_schema", bomb(18))) is None  # a cancel is nobody's refusal
    finally:
        g.close()


def test_many_requests_for_one_grammar_share_one_compile(tokenizer):
    """Guards `_flights` in `Grammars.compile_async` (`n=8` compiled the same bomb 8 times)."""
    g = grammars_for(tokenizer, timeout_s=0.4, workers=1)

    async def eight():
        spec = GrammarSpec("json_schema", bomb(16))
        return await asyncio.gather(*(g.compile_async(spec) for _ in range(8)), return_exceptions=True)

    try:
        t0 = time.monotonic()
        results = asyncio.run(eight())
        assert all(isinstance(r, BudgetExceeded) for r in results), results
        assert g.sandbox.killed == 1 and time.monotonic() - t0 < 2.5
    finally:
        g.close()


def test_a_full_compile_pool_refuses_more_with_busy(tokenizer):
    """Guards the `max_waiting` bound in `Grammars.compile_async` (8 concurrent bombs
    filled the event loop's default pool and an ordinary schema waited 13 s)."""
    g = grammars_for(tokenizer, timeout_s=0.3, workers=1)
    budget = g.budget

    async def flood():
        specs = [GrammarSpec("json_schema", bomb(16) + " " * i) for i in range(budget.workers + budget.max_waiting + 1)]
        return await asyncio.gather(*(g.compile_async(s) for s in specs), return_exceptions=True)

    try:
        results = asyncio.run(flood())
        assert isinstance(results[-1], GrammarBusy) and "retry later" in str(results[-1])
        assert all(isinstance(r, BudgetExceeded) for r in results[:-1])
    finally:
        g.close()


def test_an_ordinary_grammar_does_not_wait_behind_bombs(tokenizer):
    """Guards the fast lane in `Grammars._in_lanes` (8 concurrent bombs made an ordinary
    schema wait 13 s; in one pool it waited for every bomb's whole budget before it)."""
    g = grammars_for(tokenizer, timeout_s=0.5, workers=1)

    async def behind_bombs():
        bombs = [asyncio.ensure_future(g.compile_async(GrammarSpec("json_schema", bomb(17) + " " * i)))
                 for i in range(3)]
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        ordinary = await g.compile_async(GrammarSpec("json_schema", '{"type": "integer"}'))
        waited = time.monotonic() - t0
        return ordinary, waited, await asyncio.gather(*bombs, return_exceptions=True)

    try:
        ordinary, waited, bombs = asyncio.run(behind_bombs())
        assert ordinary.nbytes > 0 and waited < 1.2, waited  # one pool: 3 x 0.5 s at least
        assert all(isinstance(b, BudgetExceeded) and b.budget == "time" for b in bombs), bombs
        assert g.sandbox.sliced == 3 and g.sandbox.killed == 3
    finally:
        g.close()


def test_the_grammar_cache_is_bounded_by_bytes(tokenizer):
    """Guards `_ByteLRU` (the cache was bounded by count: 100 distinct 50k-value enums took a
    worker from 632 to 2,159 MiB for good)."""
    g = grammars_for(tokenizer, cache_bytes=3 << 20)
    try:
        held = [g.compile(enum(5000, f"e{i}")).nbytes for i in range(6)]
        assert min(held) > 1 << 20  # each entry holds over a MiB, so six exceed the cap
        assert g.cache_bytes <= 3 << 20 and len(g._cache) < 6
        assert g.cached(enum(5000, "e5")) is not None and g.cached(enum(5000, "e0")) is None  # oldest out
    finally:
        g.close()


def test_a_grammar_whose_first_step_allows_nothing_is_refused(tokenizer):
    """Guards `probe.dead` and the first-mask check in `grammar_child.build` (a `$ref` cycle
    answered 200 with output that violated it; `{"const": "<|eos|>"}`, which compiles and
    dead-ends later, is the engine's: tests/test_hardening.py)."""
    g = grammars_for(tokenizer)
    try:
        with pytest.raises(GrammarError) as e:
            g.compile(GrammarSpec("json_schema", '{"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}'))
        assert not isinstance(e.value, BudgetExceeded) and "json schema allows no output" in str(e.value)
    finally:
        g.close()


def test_a_lone_surrogate_in_a_regex_is_a_grammar_error(tokenizer):
    """Guards the `ValueError` catch in `grammar_source` (a TGI regex with a lone surrogate
    raised `UnicodeEncodeError` on the worker: a 500, counted against its breaker)."""
    g = grammars_for(tokenizer)
    try:
        with pytest.raises(GrammarError, match="regex cannot be enforced"):
            g.compile(GrammarSpec("regex", "a\ud800b"))
    finally:
        g.close()


def test_a_megabyte_refusal_quotes_at_most_64_characters(tokenizer):
    """Guards `engine_reason` and `verbose_errors=False` (a 1 MB invalid regex came back in a
    3 MB 422)."""
    g = grammars_for(tokenizer)
    try:
        with pytest.raises(GrammarError) as e:
            g.compile(GrammarSpec("regex", "a" * 1_000_000 + "["))
        assert len(str(e.value)) < 300, str(e.value)[:400]
    finally:
        g.close()


def test_the_budget_refuses_bad_values_by_name():
    for kwargs, needle in (({"timeout_s": 0}, "`--grammar-compile-timeout 0`"),
                           ({"memory_bytes": 0}, "`--grammar-compile-memory-mib 0`"),
                           ({"workers": 0}, "`--grammar-compile-workers 0`"),
                           ({"cache_bytes": -1 << 20}, "`--grammar-cache-mib -1`")):
        with pytest.raises(ValueError, match=needle.replace("-", r"\-")):
            CompileBudget(**kwargs)


def test_closing_stops_every_child(tokenizer):
    """Guards `CompileSandbox.close` in `Grammars.close` (the worker's lifespan end): no
    compile child outlives the worker's app."""
    g = grammars_for(tokenizer, workers=2)

    async def two():
        specs = [GrammarSpec("json_schema", json.dumps({"type": "integer", "minimum": i})) for i in range(2)]
        return await asyncio.gather(*(g.compile_async(s) for s in specs))

    asyncio.run(two())
    children = list(g.sandbox._children)
    assert children and all(c.proc.poll() is None for c in children)
    g.close()
    assert all(c.proc.poll() is not None for c in children)
