"""Routing: which worker gets a request, in stages that never call back into each other.

1. filter (`filter`): ready, circuit breaker admitting, not the process that already failed
   this request, room in its queue, the request's constraints (pinned worker, minimum
   capability, fp8 convention): the eligible workers, or a refusal with its reason;
2. score (`policy`): the engine-seconds until the request would be done there, from the
   prompt prefix the worker holds (`prefix_index`), the tokens in flight there and its
   measured speed (`speed`, `telemetry`), its free KV cache;
3. pick (`router`): the cheapest, unless a session places it (`sessions`) or the loads are
   uneven; the router holds the state and says why (`X-Hetserve-Route`, `/workers`, and
   `metrics`).
The dispatcher (server/dispatch/) runs the filter, then asks the router to pick.
`--routing cache-aware|least-loaded|round-robin` and its parameters: server/config/routing.py.
"""
