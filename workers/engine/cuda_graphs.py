"""CUDA (or HIP) graphs of the compiled decode step (workers/engine/compiled.py), one per bucket.

Design: each capture warms its function twice on a side stream (Triton's JIT, cuBLAS's handles
and workspaces), then records it into one memory pool shared by every bucket of the worker, so
the buckets' graphs cost one pool, not one each. Trade-off: a replay overwrites the previous
replay's output, so the caller copies what it keeps.
"""

from __future__ import annotations

import torch


class CudaGraphs:
    """CUDA (or HIP) graphs on the bound device, sharing one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = None

    def capture(self, fn):
        """Warm `fn` on a side stream, capture it, and return a replay that gives its output."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # Triton's JIT, cuBLAS's handles and workspaces before capture
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay
