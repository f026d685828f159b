"""The one device a worker serves: binding it first (`bind.py`, with `build.py` checking that the
installed torch can drive it), the one guard for every device switch (`guard.py`), the host
allocator kept from handing each step's temporaries back to the kernel (`host_memory.py`), and
the slowed-down simulated device of benchmarks (`slowdown.py`).

Nothing else in the worker reads a capability or selects a device: everything later asks the
frozen `BoundDevice` that `bind_device()` returned."""
