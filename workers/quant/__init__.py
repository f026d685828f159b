"""Quantization on the worker: the fp8 convention and its arithmetic, `--quantize fp8`, and pre-quantized
checkpoints (the quantization-method registry and the layers that run them).

The fp8 convention of this device (`fp8_convention`: native e4m3 or emulated, from the contract's
`fp8_rule`, locked once per process), the one fp8 arithmetic (`e4m3`: formats, exact rounding, bytes
to values, a checkpoint's scale layout), tensors to fp8 bytes in a convention (`fp8_quantize`) and
`--quantize fp8` (`quantize_model`: `Fp8Linear`, which gets this device's kernel through the plan the
kernelize step recorded on the model, `model.kernel_plan.apply`).

One module per method of `config.json`'s `quantization_config` (`compressed_tensors`: llm-
compressor's `float-quantized` fp8; `fp8_blockwise`: the `quant_method: fp8` format of Qwen3-FP8
and DeepSeek, 128 x 128 weight blocks), as the architecture registry holds one module per family:
each reads its config into one `QuantConfig` that maps every linear layer to its `Fp8Scheme`
(or to none: an `ignore` entry), and refuses what it does not know with a named error listing what
it supports (`registry.py`). The layer `Fp8CheckpointLinear` (`linear.py`) holds the stored bytes and
scales, `Fp8FusedMoE` (`experts.py`) a mixture-of-experts layer's stacked fp8 experts; the fp8 step turns it into the device's own execution (`prepare.py`: native, weight-only or
dequantized, from the one fp8 rule). This package sits below `workers.model` (the loader reads
through it, the fp8 step runs it on the loaded model) and imports neither the model nor the
kernelize step.
"""
