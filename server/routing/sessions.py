"""Session affinity: one conversation stays on one worker while that worker can take it.

A client names its conversation with `X-Session-Id` (or the OpenAI `user` field). Its first
request is placed by consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam),
on a ring with a stable hash (blake2b) so placements do not depend on the process's hash seed;
later requests go back to the worker it was last sent to while that worker can take it within
the same bound, else the session moves and the move is counted (`SessionAffinity.place`).
Trade-off: the router remembers the last worker of up to `max_sessions` sessions (least recently
used forgotten first) so that a session that moved stays where it went, rather than bouncing
back to its ring position once the old worker returns and losing the cache it built on the new
one; a forgotten session is placed by the ring again, which may move it without a count.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from server.config.routing import DEFAULT_LOAD_FACTOR
from server.routing.policy import bounded_load

DEFAULT_MAX_SESSIONS = 65536
DEFAULT_VNODES = 64
UNAVAILABLE, OVERLOADED = "unavailable", "overloaded"


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class Placement:
    worker: str
    moved_from: str | None = None  # the worker the session left, when it moved
    why: str | None = None  # UNAVAILABLE | OVERLOADED, when it moved


class SessionAffinity:
    """Where each session goes. Lives on the router's event loop.

    Every worker id has `vnodes` points on a hash ring; a new session's hash picks a point and
    the session goes to the first worker clockwise that can take it and whose load (requests in
    flight, this one included) would stay within `load_factor` times the mean load plus one (at
    light load a request or two more is noise). A session whose last worker cannot take it
    moves (placed on the ring again, skipping the full workers), counted in `moves` with why:
    `unavailable` (not among those that can take the request: not ready, breaker open, failed
    it, full) or `overloaded` (above the bound)."""

    def __init__(self, load_factor: float = DEFAULT_LOAD_FACTOR, max_sessions: int = DEFAULT_MAX_SESSIONS,
                 vnodes: int = DEFAULT_VNODES):
        if load_factor < 1.0:
            raise ValueError(f"session load factor must be >= 1.0, got `{load_factor}`")
        if max_sessions < 1:
            raise ValueError(f"max sessions must be >= 1, got `{max_sessions}`")
        self.load_factor = load_factor
        self.max_sessions = max_sessions
        self.vnodes = vnodes
        self._last: OrderedDict[str, str] = OrderedDict()
        self._ring: list[tuple[int, str]] = []
        self._ring_ids: frozenset[str] = frozenset()
        self.moves: dict[tuple[str, str], int] = {}  # (worker left, why) -> sessions moved away

    def __len__(self) -> int:
        return len(self._last)

    def bound(self, loads: Mapping[str, int]) -> int:
        """The most requests a worker may have in flight, this one included, to take a session."""
        return bounded_load(loads.values(), self.load_factor)

    def place(self, session: str, loads: Mapping[str, int], all_ids: Sequence[str]) -> Placement:
        """The worker for this session's next request. `loads`: requests in flight on each worker
        that can take the request now (not empty); `all_ids`: every worker, for a ring that stays
        put while workers come and go."""
        assert loads, "place() needs at least one worker that can take the request"
        bound = self.bound(loads)
        last = self._last.get(session)
        if last is not None and last in loads and loads[last] + 1 <= bound:
            self._remember(session, last)
            return Placement(last)
        worker = self._on_ring(session, loads, bound, all_ids)
        self._remember(session, worker)
        if last is None or last == worker:
            return Placement(worker)
        why = OVERLOADED if last in loads else UNAVAILABLE
        self.moves[(last, why)] = self.moves.get((last, why), 0) + 1
        return Placement(worker, moved_from=last, why=why)

    def forget(self, session: str) -> None:
        self._last.pop(session, None)

    def _remember(self, session: str, worker: str) -> None:
        self._last[session] = worker
        self._last.move_to_end(session)
        while len(self._last) > self.max_sessions:
            self._last.popitem(last=False)

    def _on_ring(self, session: str, loads: Mapping[str, int], bound: int, all_ids: Sequence[str]) -> str:
        """The first worker clockwise from the session's point that can take it within the bound
        (if every one is above it: the least loaded)."""
        ids = frozenset(all_ids) | frozenset(loads)
        if ids != self._ring_ids:
            self._ring = sorted((_hash(f"{wid}#{v}"), wid) for wid in ids for v in range(self.vnodes))
            self._ring_ids = ids
        start = bisect.bisect(self._ring, (_hash(session), ""))
        seen: set[str] = set()
        for i in range(len(self._ring)):
            wid = self._ring[(start + i) % len(self._ring)][1]
            if wid in seen:
                continue
            seen.add(wid)
            if wid in loads and loads[wid] + 1 <= bound:
                return wid
        return min(loads, key=lambda w: (loads[w], w))
