"""Whose fault a failed request is: the request's, or the worker's; and requests that kill workers.

Two rules (workers/contract/errors.py names the error types). A request fault is not a worker
fault: an answer whose `error_type` blames the request (`validation`, or `request_failed`: a 500
for one request that raised while the worker serves on) is the answer, not retried on another
worker that would fail it the same way, no verdict on the worker's breaker, and a stream that
ends with one ends there. A request that was in flight when a worker died is retried at most
once (`Deaths`): at the second death it is refused with a 422 that says so, since it may be
what kills them, and `Quarantine` refuses the same request again at once. Only a process that
died on its own counts: one the router stopped itself (hung, unhealthy too long, a canary's
restart) was not killed by its requests, which are moved without a mark (a request that hangs
workers is still bounded by the retries and the migration limit). Trade-off: a request
that happened to be in flight at two unrelated deaths is refused too; its client gets a clear
422 that it may resend after `QUARANTINE_S`, where the alternative was a request free to kill
every worker in turn.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from workers.contract import RESUME_IDS, WireRequest
from workers.contract.errors import ERROR_VALIDATION, is_request_fault

DEATHS_BEFORE_REFUSAL = 2  # workers that may die with a request in flight before it is refused
QUARANTINE_SIZE = 1024  # refused requests remembered
QUARANTINE_S = 600.0  # how long a refused request stays refused


def reply_error_type(content: bytes) -> str | None:
    """A worker error body's `error_type` (`{"error", "error_type"}`), or None."""
    try:
        value = json.loads(content)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    kind = value.get("error_type") if isinstance(value, dict) else None
    return kind if isinstance(kind, str) else None


def request_fault(status: int, content: bytes) -> bool:
    """Does this worker answer blame the request rather than the worker?"""
    return status >= 400 and is_request_fault(reply_error_type(content))


def fingerprint(path: str, body: WireRequest) -> str:
    """The identity of a request for the quarantine: its path and body (without `resume_ids`,
    which only say how far a stream had come)."""
    kept = body.model_dump(mode="json", exclude_unset=True, exclude={RESUME_IDS})
    text = json.dumps([path, kept], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "backslashreplace")).hexdigest()


@dataclass
class Deaths:
    """One request's record of the workers that died while it was in flight there: the
    connection broke under it, or the stream ended with an `internal` error."""

    workers: list[str] = field(default_factory=list)

    def witnessed(self, worker_id: str) -> bool:
        """Note a death under the request; True when it must not be sent anywhere again."""
        self.workers.append(worker_id)
        return len(self.workers) >= DEATHS_BEFORE_REFUSAL

    def reason(self) -> str:
        shown = " and ".join(f"`{w}`" for w in self.workers)
        return (f"The request was in flight when workers {shown} died; it is not sent to another worker, since it "
                f"may be what kills them. Accepted: the same request again after {QUARANTINE_S:g} s, or a "
                "different one")


class Quarantine:
    """Fingerprints of requests refused for killing workers, with why (a bounded LRU by path and
    body, expiring), so the same request sent again is refused before it reaches any worker; it
    costs nothing while empty."""

    def __init__(self, size: int = QUARANTINE_SIZE, ttl_s: float = QUARANTINE_S, clock=time.monotonic):
        self.size, self.ttl_s, self._clock = size, ttl_s, clock
        self._entries: OrderedDict[str, tuple[float, str]] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._entries)

    def add(self, key: str, reason: str) -> None:
        self._entries.pop(key, None)
        self._entries[key] = (self._clock() + self.ttl_s, reason)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def reason(self, key: str) -> str | None:
        """Why `key` is refused, or None (an expired entry is dropped)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[0] < self._clock():
            del self._entries[key]
            return None
        return entry[1]


REFUSED_TYPE = ERROR_VALIDATION  # the error type of a refused request (a 422)
