"""Quantization on the worker, every concern of it: the fp8 convention and its arithmetic,
`--quantize fp8`, the pre-quantized checkpoint formats, their readers, and each scheme's
execution on this device.

Its modules, by facet: the fp8 convention and arithmetic (`fp8_convention`, `e4m3`,
`fp8_quantize`); `--quantize fp8` (`quantize_model`); one module per checkpoint method, as the
architecture registry holds one per family (`registry`, `scheme`, `compressed_tensors`,
`fp8_blockwise`, `int4_methods`, `int4_scheme`, `gptq`, `awq`, `pack_quantized`, `int4_pack`,
`mxfp4`); the readers that load a checkpoint's tensors for this device (`checkpoint`,
`fp8_reader`, `int4_reader`, `mxfp4_reader`); the layers that run the stored bytes the device's
way (`linear`, `experts`, `int4_linear`, `mxfp4_experts`) and the fp8 step preparing them
(`prepare`); the kernels live in kernels_local/, the device rules' thresholds in the contract.
The package sits below `workers.model` and imports neither the model nor the kernelize step:
what it needs of them is handed in (the loader's `ModelMap`, the kernel plan recorded on the
model). Trade-off: that boundary is a few callables, checked by the tests that load real
checkpoints rather than by an import."""
