"""Routing: which worker gets a request, in three stages.

1. filter (server/balancer.py): ready, circuit breaker admitting, not the process that
   already failed this request, room in its queue, the request's constraints (pinned worker,
   minimum capability, fp8 convention);
2. score (server/routing/policy.py): the engine-seconds until the request would be done
   there, from the prompt prefix the worker holds (prefix_index.py), the tokens in flight
   there and its measured speed (speed.py, telemetry.py), its free KV cache;
3. pick: the cheapest, unless a session places it (sessions.py) or the loads are uneven.

`--routing cache-aware|least-loaded|round-robin` (config.py); server/routing/router.py holds
the state and says why (`X-Hetserve-Route`, `/metrics`, `/workers`).
"""
