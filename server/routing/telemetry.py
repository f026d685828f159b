"""What the router learns from the workers' own counters: speeds, KV use, characters per token.

Each `/metrics` sample the status page takes (server/fleet/history.py) is also handed here. The
change of a worker's counters since its previous sample is one interval of work (engine seconds
and steps, prompt tokens computed, tokens generated) for its `SpeedFit`; the prompt tokens it
was sent, set against the characters of the text prompts the router sent it meanwhile, teach the
router how many characters make a token (it has no tokenizer). A new process (another pid) or a
counter that went down starts the worker's counters afresh; its speed estimate is kept (same
device). Trade-off: counters are cumulative and sampled every couple of seconds, so the estimates
lag the traffic by an interval or two, and a request's characters are counted when it is sent
while its tokens are counted when the worker admits it; over several intervals the two agree.
No extra request is made to the workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.fleet.history import read_values
from server.routing.phases import PhaseFit, read_moments
from server.routing.speed import DEFAULT_DECAY, Speed, SpeedFit
from workers.contract import GATEWAY_KV_USAGE

STEP_SECONDS = "hetserve_worker_step_seconds_sum"
STEPS = "hetserve_worker_step_seconds_count"
GENERATED = "hetserve_worker_generated_tokens_total"
PREFILL_COMPUTED = 'hetserve_worker_prefill_tokens_total{kind="computed"}'
PREFILL_SKIPPED = 'hetserve_worker_prefill_tokens_total{kind="skipped"}'
PROMPT_TOKENS = "hetserve_worker_prompt_tokens_total"  # an engine without a prefix cache
KV_USAGE = GATEWAY_KV_USAGE[0]
_HEADS = frozenset({STEP_SECONDS, STEPS, GENERATED, PREFILL_COMPUTED, PREFILL_SKIPPED, PROMPT_TOKENS, KV_USAGE})

DEFAULT_CHARS_PER_TOKEN = 4.0  # until measured (English text with a BPE tokenizer: 3 to 4.5)
_CHARS_PER_TOKEN_RANGE = (1.0, 8.0)
_MIN_CHARS = 2000  # an interval with fewer characters sent says too little about the ratio
_RATIO_WEIGHT = 0.3  # weight of a new interval in the characters-per-token average


@dataclass(frozen=True)
class Counters:
    """One sample of a worker's cumulative counters."""

    busy_s: float
    steps: float
    computed: float  # prompt tokens computed (not found in the prefix cache)
    prompt: float  # prompt tokens admitted (computed + found in the prefix cache)
    generated: float
    kv_usage: float | None

    @classmethod
    def read(cls, text: str) -> Counters | None:
        v = read_values(text, _HEADS)
        if STEP_SECONDS not in v or STEPS not in v or GENERATED not in v:
            return None
        computed = v.get(PREFILL_COMPUTED, v.get(PROMPT_TOKENS, 0.0))
        return cls(v[STEP_SECONDS], v[STEPS], computed, computed + v.get(PREFILL_SKIPPED, 0.0), v[GENERATED],
                   v.get(KV_USAGE))


@dataclass
class _Worker:
    fit: SpeedFit
    phases: PhaseFit  # per phase, over its steps (server/routing/phases.py)
    pid: int | None = None
    last: Counters | None = None
    kv_usage: float | None = None
    chars_sent: float = 0.0  # characters of text prompts sent since the last sample
    ids_sent: float = 0.0  # token ids sent since the last sample (id prompts, resumed streams)


@dataclass
class Telemetry:
    """Per-worker speeds and KV use, and the fleet's characters per token (see the module docstring)."""

    decay: float = DEFAULT_DECAY
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN
    _workers: dict[str, _Worker] = field(default_factory=dict)

    def _of(self, worker_id: str) -> _Worker:
        if worker_id not in self._workers:
            self._workers[worker_id] = _Worker(SpeedFit(self.decay), PhaseFit())
        return self._workers[worker_id]

    def sent(self, worker_id: str, chars: int, ids: int) -> None:
        """A prompt of `chars` characters of text and `ids` token ids went to the worker."""
        w = self._of(worker_id)
        w.chars_sent += chars
        w.ids_sent += ids

    def observe(self, worker_id: str, pid: int | None, text: str | None) -> None:
        """One `/metrics` sample of the worker (None: it did not answer)."""
        w = self._of(worker_id)
        now = Counters.read(text) if text is not None else None
        if now is None:
            w.kv_usage = None
            return
        w.kv_usage = now.kv_usage
        last, w.last = w.last, now
        restarted = pid != w.pid or last is None or now.steps < last.steps or now.generated < last.generated
        w.pid = pid
        w.phases.observe(read_moments(text), restarted)
        chars, ids, w.chars_sent, w.ids_sent = w.chars_sent, w.ids_sent, 0.0, 0.0
        if restarted:
            return
        w.fit.observe(now.steps - last.steps, now.computed - last.computed, now.generated - last.generated,
                      now.busy_s - last.busy_s)
        self._learn_ratio(chars, (now.prompt - last.prompt) - ids)

    def _learn_ratio(self, chars: float, text_tokens: float) -> None:
        if chars < _MIN_CHARS or text_tokens <= 0:
            return
        low, high = _CHARS_PER_TOKEN_RANGE
        sample = min(high, max(low, chars / text_tokens))
        self.chars_per_token += _RATIO_WEIGHT * (sample - self.chars_per_token)

    def speed(self, worker_id: str) -> Speed | None:
        w = self._workers.get(worker_id)
        return None if w is None else w.fit.estimate()

    def phases(self, worker_id: str) -> Speed | None:
        """The worker's step-time model fitted over its steps (server/routing/phases.py), None
        until enough steps with and without prompt tokens were seen."""
        w = self._workers.get(worker_id)
        return None if w is None else w.phases.estimate()

    def kv_usage(self, worker_id: str) -> float | None:
        w = self._workers.get(worker_id)
        return None if w is None else w.kv_usage

    def tokens(self, chars: float) -> int:
        """Characters of text as an estimated number of tokens."""
        return int(round(chars / self.chars_per_token))
