"""The model a worker serves, as one unit: its configuration (`config`, read through `hf_config`,
per-layer shapes in `layer_shapes`), the decoder (`transformer`, `attention`, `rope`, the
kernel-swappable `layers`, the experts of `moe` and `moe_block`, the linear attention of
`linear_attention`, Gemma 4's `per_layer_inputs`), one module per architecture family
(`families/`), the one Hugging Face name map (`weights`), the loader that reads a checkpoint
directory (`loader`) and the architecture described as JSON (`describe`); plus the numerics a
worker bounds after loading: batch-invariant projections and attention (`deterministic`), the
CPU's packed projections (`cpu_projections`) and few padded matmul shapes on CPU (`row_buckets`)."""
