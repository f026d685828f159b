"""The serve step: the worker's HTTP app on its Unix socket, built over the ready engine.

`server` builds the KV cache, the engine and the app from one `Startup` value and runs
uvicorn on the socket; `app` is the app factory; the routes (`routes/`) reach the worker
through one `context` dependency, like the router's; `schemas` are the TGI shapes at this
edge, `errors` its error answers, `headers` the identity on every answer and `tracing` the
span of each request.
"""
