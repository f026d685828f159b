"""A submitted request made into the engine's `Sequence`, and the engine's two refusals of one.

Design: `Engine.submit` admits (counts the request in flight, or refuses it) under its lock and
hands the rest here, outside the lock: the seeded generator (skipping the draws of resumed
tokens), the detokenizer (or `NoText` where the router builds the text from the token ids), the
stream the events go to, the grammar's matcher, and the resumed tokens replayed. Trade-off: one
more module for a dozen lines, which keeps the engine's loop and its admission apart.
"""

from __future__ import annotations

import asyncio
import secrets

from workers.contract.detokenize import IncrementalDetokenizer, NoText
from workers.engine.events import RequestStream
from workers.engine.resume import replay
from workers.engine.sequence import Sequence
from workers.sampling.grammar import CompiledGrammar
from workers.sampling.params import SamplingParams
from workers.sampling.sampler import make_generator


class EngineOverloaded(RuntimeError):
    """The bounded queue is full (HTTP 429)."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class EngineUnavailable(RuntimeError):
    """The engine is draining, stopped or dead (HTTP 503)."""


def new_sequence(rid: str, prompt_ids: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop | None,
                 grammar: CompiledGrammar | None, resumed: list[int], text: bool, tokenizer,
                 special_ids) -> Sequence:
    """The sequence of an admitted request, ready for the scheduler (its resumed tokens replayed)."""
    seq = Sequence(rid, prompt_ids, params)
    seed = params.seed
    if params.do_sample:
        seed = secrets.randbits(53) if seed is None else seed
        seq.generator = make_generator(seed, skip=len(resumed))
    seq.seed = seed
    seq.detok = NoText(special_ids) if not text else IncrementalDetokenizer(
        tokenizer, seq.prompt_ids, special_ids, params.stop, params.include_stop_str_in_output,
        params.skip_special_tokens, params.min_tokens)
    seq.stream = RequestStream(rid, loop)
    seq.stream.seed = seed
    if grammar is not None:
        seq.grammar = grammar.matcher()
    replay(seq, resumed)
    return seq
