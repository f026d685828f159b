"""hetserve router: CLI, inventory, supervisor, balancer and the public HTTP API.

The router process never initializes CUDA and never imports torch: it inventories GPUs
through NVML (or the simulated topology) and leaves every device decision to the worker
that owns that device.
"""
