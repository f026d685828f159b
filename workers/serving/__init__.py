"""The serve step: the worker's HTTP app on its Unix socket, over the engine the earlier steps built.

`server` receives the built engine and the `/capability` description (workers/main.py assembles
both: workers/engine/build.py, workers/engine/describe.py) and runs uvicorn on the socket; `app`
is the app factory; the routes (`routes/`) reach the worker through one `context` dependency,
like the router's; `render` gives the TGI shapes at this edge, `errors` its error answers,
`headers` the identity on every answer, `tracing` the span of each request and `channel` the
router's one stream of every streamed request's events."""
