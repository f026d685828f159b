"""Speculative decoding in the engine: decode rows carry draft tokens, verified in the same step.

Design: before each schedule, `Speculator.propose` gives every eligible running decode row up to k
draft tokens (workers/spec: n-gram lookup or suffix trees; or the checkpoint's MTP head,
workers/engine/mtp.py; k per row from the policy, which weighs this device's step costs, measured by
`Speculator.observe` after every step, against the rows' acceptance). The scheduler runs such a row
as a chunk of k+1 tokens (its last token and the drafts) over its cached context, the same path a
prompt chunk takes, and the forward projects logits at all k+1 positions. `Speculator.step` then
verifies (greedy: argmax; sampled: the request's generator, workers/spec/rejection.py) position by
position, each position's logits processed as if the drafts before it were already output
(penalties, bias, `min_tokens`), and feeds the emitted tokens one at a time through the scheduler's
`append_token` and the output processor, round by round, so EOS, stop ids, stop strings,
`max_tokens`, logprobs and streams see exactly the tokens plain decoding would have produced, and
nothing after a finish. Then `num_computed` covers the last token and the accepted drafts only, and
the blocks holding only rejected positions go back to the pool (`KVCacheManager.trim`); rejected K/V
left in a kept block sits past `num_computed` and is overwritten by the next token. Trade-off: a
drafted row runs as a prompt chunk (eager, reading the pool), giving up the compiled decode step and
the decode mirror for that row in that step; GPU kernels need no change for that, but a multi-query
decode kernel would be faster. Rows under a grammar or asking for `top_n_tokens` never draft
(workers/spec/policy.py). A hybrid's linear-attention state is rolled back to the last accepted
token (workers/model/state_rollback.py); a sliding group frees what its window left behind after the
trim. Models with a length-dependent rotary do not speculate (a draft past its threshold would be
rotated otherwise)."""

from __future__ import annotations

from dataclasses import replace

import torch

from workers.engine.mtp import MtpDrafter
from workers.engine.sequence import RUNNING
from workers.model.state_rollback import StateRollback
from workers.sampling.logprobs import prompt_chunks, record_prompt
from workers.sampling.sampler import processed_logits, sample_tokens
from workers.spec.cost import StepCosts
from workers.spec.ngram import NgramProposer
from workers.spec.policy import PRIOR_RATE, PRIOR_WEIGHT, Row, SpecDecision, SpecPolicy, ineligible, row_rate
from workers.spec.rejection import accept_greedy, accept_sampled
from workers.spec.suffix import SuffixProposer


class _Position:
    """A sequence as the sampler sees it at one draft position: its drafts before it output."""

    __slots__ = ("params", "generator", "prompt_ids", "output_ids", "grammar")

    def __init__(self, seq, drafts: list[int]):
        self.params, self.generator, self.prompt_ids = seq.params, seq.generator, seq.prompt_ids
        self.output_ids = seq.output_ids + drafts if drafts else seq.output_ids
        self.grammar = None


def _is_draft(chunk) -> bool:
    """A decode row carrying draft tokens (the scheduler's `_fits_drafts` chunk)."""
    return not chunk.is_prefill and len(chunk.token_ids) > 1


AUTO_METHOD = "suffix"  # what `auto` drafts with where it speculates
AUTO_INEXACT = ("`auto` speculates only under --deterministic, where a drafted row's logits equal the decode "
                "step's bit for bit: here they come from the prompt path, whose rounding can differ (greedy tokens "
                "in bf16, logprobs in their last bits even in fp32); `--speculative suffix` or `ngram` turns drafts "
                "on anyway")


def speculator_for(mode: str, num_tokens: int, scheduler, pipeline: bool = False, exact: bool = False,
                   mtp: MtpDrafter | None = None) -> Speculator:
    """The engine's `Speculator` for `--speculative mode` (the worker's configuration) over `scheduler`:
    n-gram, suffix-tree or MTP drafts (`mtp`: the checkpoint's head, workers/engine/mtp.py) where asked and
    the engine can verify them, else one that only says why it is off. `auto` drafts with `AUTO_METHOD`
    where the forward is `exact` (a drafted row's logits equal the decode step's: deterministic mode), k
    chosen per step from the measured costs. Raises `ValueError` for `mtp` without a head."""
    policy = SpecPolicy(num_tokens)
    if mode == "off":
        return Speculator("off", policy, off_reason="`--speculative off`")
    reason = engine_reason(scheduler, pipeline)
    if reason is not None:
        return Speculator("off", policy, off_reason=reason)
    if mode == "mtp" and mtp is None:
        raise ValueError("`--speculative mtp` needs a checkpoint that ships an MTP head (`mtp.*` tensors); this "
                         "one has none. Accepted here: auto, off, ngram, suffix")
    if mode == "auto":
        return Speculator(AUTO_METHOD, policy) if exact else Speculator("off", policy, off_reason=AUTO_INEXACT)
    return Speculator(mode, policy, mtp=mtp)


def engine_reason(scheduler, pipeline: bool) -> str | None:
    """Why this engine cannot speculate at all, or None."""
    if pipeline:
        return "a pipeline's stages do not verify drafts yet"
    if scheduler.config.rope is not None:
        return ("a rotary that depends on the sequence's length would rotate drafts past its threshold "
                "unlike plain decoding")
    return None


class Speculator:
    """The engine's speculative decoding (see the module docstring); engine thread only."""

    def __init__(self, method: str, policy: SpecPolicy, proposer: NgramProposer | None = None,
                 off_reason: str | None = None, suffix: SuffixProposer | None = None, mtp: MtpDrafter | None = None):
        """`method` "ngram", "suffix" or "mtp" (with `mtp`) drafts; "off" (with `off_reason`) proposes nothing
        and only describes why."""
        if method not in ("ngram", "suffix", "mtp", "off") or (method == "mtp") != (mtp is not None):
            raise ValueError(f"Speculative method `{method}` is not available in this engine. "
                             f"Accepted: ngram, suffix, off, and mtp with the checkpoint's MTP head")
        self.mtp = mtp
        self.method, self.policy = method, policy
        self.enabled = method != "off"
        self.proposer = proposer or NgramProposer()
        self.suffix = (suffix or SuffixProposer()) if method == "suffix" else None
        self.costs = StepCosts()  # this device's measured step costs (workers/spec/cost.py)
        self.steps = 0
        self.causes: dict[str, int] = {}  # decisions by cause since the last step's metrics
        self.chosen: dict[int, int] = {}  # steps with drafts proposed, by the k chosen
        self.last = SpecDecision(policy.max_k if self.enabled else 0, off_reason or "speculating")  # the latest
        self.drafts = self.draft_tokens = self.accepted = 0

    # -- before the schedule -------------------------------------------------------------------

    def propose(self, running) -> None:
        """Drafts for this step's decode rows (every other row's are cleared), k from the policy."""
        if not self.enabled:
            return
        self.steps += 1
        decode = []
        for seq in running:
            seq.draft_ids = []
            if seq.status == RUNNING and seq.output_ids and seq.num_tokens - seq.num_computed == 1:
                decode.append(seq)
        limits = []  # (row, the most drafts it may carry)
        for seq in decode:
            if ineligible(seq.params, seq.grammar is not None) is not None:
                continue
            generated = len(seq.output_ids)
            limit = self.policy.row_limit(seq.spec_drafted, seq.spec_accepted,
                                          seq.params.max_new_tokens - generated, generated)
            limits.append((seq, limit.k))
        if decode:  # k first, so that a step which will not speculate proposes nothing
            prior = self.accepted / self.draft_tokens if self.draft_tokens >= PRIOR_WEIGHT else PRIOR_RATE
            rows = [Row(n, row_rate(seq.spec_drafted, seq.spec_accepted, prior)) for seq, n in limits if n]
            decision = self.policy.choose(len(decode), rows, self.costs, self.steps)
            self.causes[decision.cause] = self.causes.get(decision.cause, 0) + 1
            if rows:
                self.last = decision
                self.chosen[decision.k] = self.chosen.get(decision.k, 0) + 1
            own = iter(decision.ks or [decision.k] * len(rows))  # each drafting row's own k
            for seq, n in limits:
                seq.draft_ids = self._draft(seq, min(n, next(own)) if n else 0)
        if self.suffix is not None:
            self.suffix.retire({seq.uid for seq in running})
        if self.mtp is not None:
            self.mtp.retire({seq.uid for seq in running})

    def _draft(self, seq, k: int) -> list[int]:
        if self.mtp is not None:
            return self.mtp.propose(seq, k)
        if self.suffix is not None:  # fed every step, so its trees follow the output
            return self.suffix.propose(seq.uid, seq.prompt_ids, seq.output_ids, k)
        return self.proposer.propose(seq.token_ids(), k) if k else []

    def observe(self, out, seconds: float, metrics) -> None:
        """A finished step's duration, kept as this device's cost of its path and size (steps with a
        prompt chunk are not: their prefill dominates; the suffix trees' one-off indexing of a new
        request's prompt is taken out), and the latest choice on `/metrics`."""
        if not self.enabled:
            return
        if self.mtp is not None:  # the hidden states the head drafts from
            self.mtp.capture(out.chunks)
        metrics.spec_k.set(self.last.k)
        for cause, n in self.causes.items():
            metrics.spec_decisions.labels(cause).inc(n)
        self.causes.clear()
        if self.suffix is not None:  # indexing a prompt is paid once per request, not per step of its path
            seconds -= self.suffix.indexing_seconds
            self.suffix.indexing_seconds = 0.0
        if not out.chunks or any(c.is_prefill for c in out.chunks):
            return
        if any(_is_draft(c) for c in out.chunks):
            self.costs.record("spec", sum(len(c.token_ids) for c in out.chunks), seconds)
        else:
            self.costs.record("plain", len(out.chunks), seconds)

    def drafted(self, out) -> bool:
        return self.enabled and any(_is_draft(c) for c in out.chunks)

    # -- the step ------------------------------------------------------------------------------

    def step(self, engine, out, t0: float) -> int:
        """Execute, verify and update a step with drafted rows (the engine's `_step` after schedule)."""
        chunks = out.chunks
        drafted = [i for i, c in enumerate(chunks) if _is_draft(c)]
        plain = [c.seq for c in chunks if c.samples and not _is_draft(c)]
        masks = engine._start_masks(plain)
        # 1. one forward: logits at every row of drafted and scored chunks, the last row of the others
        scored = prompt_chunks(chunks)
        wanted = sorted(set(scored) | set(drafted))
        states = getattr(engine.runner.kv, "states", None)  # linear layers' state: rolled back on rejection
        if states is not None:
            states.recorder = StateRollback(chunks[i].seq.state_slot for i in drafted)
        try:
            logits, spans = engine.runner.execute_with_prompt_logits(out, wanted)
        finally:
            recorder = None if states is None else states.recorder
            if states is not None:
                states.recorder = None
        span_of = dict(zip(wanted, spans, strict=True))
        for i in scored:
            record_prompt(chunks[i], span_of[i])
        # 2. plain rows sample as in any step; drafted rows verify
        sched, eos = engine.scheduler, engine.scheduler.config.eos_token_ids
        rows = [j for j, c in enumerate(c for c in chunks if c.samples) if not _is_draft(c)]
        sampled = None
        if plain:
            sampled = sample_tokens(logits[rows], plain, engine.grammars,
                                    None if masks is None else masks.result(), eos)
        emitted = self._verify([chunks[i] for i in drafted], [span_of[i] for i in drafted], eos, engine.metrics)
        if recorder is not None:  # each row's state as after its last token and accepted drafts
            for i, (tokens, _) in zip(drafted, emitted, strict=True):
                recorder.rollback(states, chunks[i].seq.state_slot, len(tokens))
        # 3. update: the plain chunks as in any step, then the drafted rows' tokens round by round
        rest = replace(out, chunks=tuple(c for c in chunks if not _is_draft(c)))
        updates = sched.update_from_output(rest, sampled.token_ids if sampled else [],
                                           sampled.logprobs if sampled else [])
        tops = {} if sampled is None else {id(s): t for s, t in zip(plain, sampled.top, strict=True) if t is not None}
        for i, (tokens, _) in zip(drafted, emitted, strict=True):
            chunks[i].seq.num_computed = chunks[i].start_pos + len(tokens)  # its last token and accepted drafts
        events, finished, count = [], [], 0
        for j in range(max(len(tokens) for tokens, _ in emitted)):
            updates += [sched.append_token(chunks[i].seq, tokens[j], lps[j])
                        for i, (tokens, lps) in zip(drafted, emitted, strict=True)
                        if j < len(tokens) and chunks[i].seq.status == RUNNING]
            if not updates:
                break
            outputs = engine.output.process(updates, tops if j == 0 else {}, t0)
            events += outputs.events
            finished += outputs.finished
            count += len(updates)
            updates = []
        for i in drafted:
            self._settle(sched, chunks[i].seq)
        engine._end_step(out, events, finished, count, t0)
        return len(chunks)

    def _verify(self, chunks, spans, eos, metrics) -> list[tuple[list[int], list[float]]]:
        """Per drafted chunk, the tokens it emits and their logprobs (accepted drafts, then one more)."""
        result: list[tuple[list[int], list[float]] | None] = [None] * len(chunks)
        greedy = [n for n, c in enumerate(chunks) if not c.seq.params.do_sample]
        if greedy:  # every position of every greedy row in one sampler call, as plain greedy rows
            views = [_Position(chunks[n].seq, chunks[n].token_ids[1:j + 1])
                     for n in greedy for j in range(len(chunks[n].token_ids))]
            out = sample_tokens(torch.cat([spans[n] for n in greedy]), views, eos_ids=eos)
            row = 0
            for n in greedy:
                width = len(chunks[n].token_ids)
                ids, lps = out.token_ids[row:row + width], out.logprobs[row:row + width]
                kept = accept_greedy(ids, chunks[n].token_ids[1:]) + 1
                result[n] = (ids[:kept], lps[:kept])
                row += width
        for n, c in enumerate(chunks):
            if result[n] is None:  # sampled: the request's generator, one uniform per token
                drafts = c.token_ids[1:]
                views = [_Position(c.seq, drafts[:j]) for j in range(len(c.token_ids))]
                logprobs = torch.log_softmax(processed_logits(spans[n], views, eos_ids=eos), dim=-1)
                tokens = accept_sampled(logprobs, drafts, c.seq.generator)
                result[n] = (tokens, [float(logprobs[j, t]) for j, t in enumerate(tokens)])
        for c, (tokens, _) in zip(chunks, result, strict=True):
            self._count(c.seq, len(c.token_ids) - 1, len(tokens) - 1, metrics)
        return result

    def _count(self, seq, drafted: int, accepted: int, metrics) -> None:
        seq.spec_drafted += drafted
        seq.spec_accepted += accepted
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted += accepted
        metrics.spec_drafts.inc()
        metrics.spec_draft_tokens.inc(drafted)
        metrics.spec_accepted_tokens.inc(accepted)

    @staticmethod
    def _settle(sched, seq) -> None:
        """A drafted row still running: index its blocks that became full, free the rejected ones
        and, in a sliding group, those its window left behind (as `update_from_output` does)."""
        seq.draft_ids = []
        if seq.status != RUNNING:
            return
        if seq.num_computed // sched.config.block_size > seq.num_cached_blocks:
            sched.kv.cache_full_blocks(seq)
        sched.kv.trim(seq, seq.num_computed)
        if sched.kv.sliding:
            sched.kv.slide(seq)

    # -- description -----------------------------------------------------------------------------

    def describe(self) -> dict:
        """`/capability` `speculative`: method, k, acceptance so far and the latest decision's reason."""
        rate = self.accepted / self.draft_tokens if self.draft_tokens else None
        if not self.enabled:
            return {"method": "off", "k": 0, "reason": self.last.reason}
        return {"method": self.method, "num_speculative_tokens": self.policy.max_k, "k": self.last.k,
                "reason": self.last.reason, "cause": self.last.cause, "step_ms": self.costs.describe(),
                "k_steps": {str(k): n for k, n in sorted(self.chosen.items())},
                "acceptance_rate": rate, "drafts": self.drafts,
                "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted,
                "tokens_per_draft_step": (self.accepted + self.drafts) / self.drafts if self.drafts else None}

