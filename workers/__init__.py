"""hetserve's worker: one process per device, its packages named after the mission's steps.

`python -m workers` runs `workers/main.py`, which reads top-down as the mission: bind ->
capability -> load -> kernelize -> fp8 -> serve. Each step has its package, and a package
imports only those below it (import-linter keeps it so): `contract` (what router and worker
share, torch-free) <- `device` (bind, the guard) <- `kv` (the paged cache) and `quant` (the fp8
step's package, every quantization concern: the fp8 convention and its arithmetic, `--quantize
fp8`, the pre-quantized formats, their readers and layers) <- `model` (the architecture, its
weights, the loader) <- `kernelize` (the kernel choice, the preflight, the self-test) <-
`sampling` (parameters, sampler, grammars, logprobs) <- `engine` (the step loop and scheduler)
<- `pipeline` (a model's layers over several workers: stages, their wire) <- `serving` (the
Unix-socket app); `default_model` is the embedded checkpoint, data only. Importing this package,
or any package's `__init__`, loads nothing."""
