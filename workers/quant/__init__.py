"""Quantization on the worker, every concern of it: the fp8 convention and its arithmetic, `--quantize fp8`,
the pre-quantized checkpoint formats, their readers, and each scheme's execution on this device.

The package sits below `workers.model` and imports neither the model nor the kernelize step: the
model's loader calls into it, and the worker's fp8 step (workers/main.py) runs it on the loaded model.
Its modules, by facet:
- the fp8 convention and its arithmetic: `fp8_convention` (native e4m3 or emulated, in the encoding
  the device takes, from the contract's torch-free `fp8_rule`; one per process, locked), `e4m3` (the
  one fp8 arithmetic: formats, exact rounding onto the grid, bytes to values, a checkpoint's scale
  layout, fn to fnuz), `fp8_quantize` (tensors to fp8 bytes and back in a convention);
- `--quantize fp8`: `quantize_model` (the model's projections swapped for `Fp8Linear`);
- the formats of a checkpoint's `quantization_config`, one module per method as the architecture
  registry holds one per family: `registry` (method -> reader; an unknown one is a named error),
  `scheme` (the fp8 `QuantConfig`, `Fp8Scheme`), `compressed_tensors`, `fp8_blockwise`, and the 4-bit
  ones `int4_methods` (which reader, and the device rule with its reason), `int4_scheme`, `gptq`,
  `awq`, `pack_quantized`, `int4_pack` (their packings, dequantized as each reference does); `mxfp4`
  (gpt-oss's e2m1 experts, and their device rule);
- the readers that load a checkpoint's tensors for this device: `checkpoint` (`ModelMap`, what the
  loader hands them), `fp8_reader`, `int4_reader`, `mxfp4_reader`;
- the layers that hold the stored bytes and run them the device's way: `linear`
  (`Fp8CheckpointLinear`), `experts` (`Fp8FusedMoE`, and the expert loop both quantized expert layers
  share), `int4_linear` (`Int4CheckpointLinear`), `mxfp4_experts` (`Mxfp4FusedMoE`); and the fp8 step
  for a checkpoint, `prepare` (each fp8 layer turned into this device's execution).
The kernels themselves live in kernels_local/; the device rules' thresholds in the contract
(`fp8_rule`, `int4_rule`, `mxfp4_rule`), which the router's `hetserve plan` reads without torch.

Where the model's knowledge is needed, it is passed in, never imported. The readers lay stored
tensors out onto our modules, which takes the family's Hugging Face name map and the experts layer
that quantized experts replace: the loader hands those over as one frozen `ModelMap`, and names the
device (type and capability) the layers are laid out for, since a simulated GPU loads onto the CPU
yet keeps its GPU's execution. The readers belong here rather than in the loader because what they
decide is the format's (which tensors a scheme stores, how they are checked, which layout each
execution keeps); the loader keeps only the walk over the checkpoint's files. `--quantize fp8` gives
the layers it creates this device's kernel through the plan the kernelize step recorded on the model
(`model.kernel_plan.apply`). The quantized expert layers run the same grouping as the model's
`FusedMoE` with their own loop (`experts.run_experts`), so they need nothing of `workers.model.moe`.
The trade-off: the model's side of that boundary (`ModelMap`, the recorded plan) is a few callables,
checked by the tests that load real checkpoints rather than by an import.
"""
