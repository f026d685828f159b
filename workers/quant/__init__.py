"""Pre-quantized checkpoints: the quantization-method registry and the layers that run them.

One module per method of `config.json`'s `quantization_config` (`compressed_tensors`: llm-
compressor's `float-quantized` fp8; `fp8_blockwise`: the `quant_method: fp8` format of Qwen3-FP8
and DeepSeek, 128 x 128 weight blocks), as the architecture registry holds one module per family:
each reads its config into one `QuantConfig` that maps every linear layer to its `Fp8Scheme`
(or to none: an `ignore` entry), and refuses what it does not know with a named error listing what
it supports (`registry.py`). The layer `Fp8CheckpointLinear` (`linear.py`) holds the stored bytes and
scales, `Fp8FusedMoE` (`experts.py`) a mixture-of-experts layer's stacked fp8 experts; the fp8 step turns it into the device's own execution (`prepare.py`: native, weight-only or
dequantized, from the one fp8 rule). This package sits below `workers.model` (the loader reads
through it) and imports neither the model nor `workers.fp8`: its e4m3 arithmetic is torch's own
fp8 dtypes (`fp8_math.py`), whose casts from fp32 round once.
"""
