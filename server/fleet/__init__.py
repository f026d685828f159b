"""The worker processes and the router's view of each.

`supervisor` spawns one worker per device, waits until it is ready, probes it (`probe`) and
carries out what `exits` decides when it exits; `spec` is each worker's command line and
environment, `run_dir` their private sockets' directory, `handle` the router's live view of
one worker (its state, its reports, its `breaker`, its `canary_record`), `client` and
`uds_http` the HTTP over its Unix socket, `history` the status page's recent samples and
`metrics` the router's Prometheus registry over them all.
"""
