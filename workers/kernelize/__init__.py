"""Which kernels this device runs, and the proof that they work here.

`apply` swaps the model's layers for `kernels_local.mapping.select()`'s choice for the bound
device, after `crosscheck` found the `kernels` library's own capability equal to it; the
`preflight` compiles every chosen Triton kernel ahead of time for the device's target
(`aot`) and checks it against the architecture's limits (`arch_limits`), its results as
`records`, its command line in `cli` (`python -m workers.kernelize`); the `selftest` compares
one forward with the torch reference before the worker reports ready.
"""
