"""hetserve-panel-linear: a CPU linear (projection) by oneDNN's batch-reduce GEMM over the weight laid
out once as column panels, in C++, with `F.linear` as its reference."""

from . import layers

__all__ = ["layers"]
