"""hetserve's router: one process that starts a worker per GPU and serves the public HTTP API.

It never initializes CUDA and never imports torch: it inventories GPUs through NVML (or the
simulated topology) and leaves every device decision to the worker that owns that device.
Its packages, each importing only those below it (import-linter keeps it so): `cli` and
`commands` (hetserve's subcommands) <- `edge` (the HTTP app, its middleware and routes) <-
`protocol` (public shapes and their translation), `canary` (do the workers agree) and
`dispatch` (deliver one request, retry, migrate a stream) <- `routing` (which worker) <-
`fleet` (the worker processes and the router's view of each) <- `config` (every knob,
validated once) <- `errors`.
"""
