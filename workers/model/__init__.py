"""The model a worker serves, as one unit: its configuration (`config`), the decoder
(`transformer`, `attention`, `rope`, the kernel-swappable `layers`), the one Hugging Face name
map (`weights`) and the loader that reads a checkpoint directory (`loader`); plus the two ways
its numerics are bounded: batch-invariant projections and attention (`deterministic`), and a
few padded matmul shapes on CPU (`row_buckets`).
"""
