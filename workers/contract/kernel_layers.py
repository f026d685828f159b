"""Which of a device's kernel layers a model runs, and why not the others: one rule for `hetserve
plan --model` and for the worker's own preflight.

Design: the workers' description of the model (`workers.model.describe`: `kernel_layers_unused`,
the layers its architecture lacks, and `quantization`, what the checkpoint stores), the
`--quantize` mode and the device's own MXFP4 rule (`workers.contract.mxfp4_kind`) say which kernel
layers cannot be in that device's model, each with why: `unused_layers` returns them. The plan
lists only the others (the rest behind `--all-kernels`); a worker's preflight does not compile
them (workers/main.py `_never_run`). A layer is called unused only where it surely is absent: an
fp8 checkpoint may leave some experts unquantized, so an fp8 MoE keeps `FusedMoE` beside
`Fp8FusedMoE`. Pure, so it is tested without a process. The trade-off: which layer class each kind
of checkpoint installs (workers/quant/*_reader.py) is restated here in a few lines, as the router
cannot import the loader.
"""

from __future__ import annotations

from workers.contract.defaults import NO_GGUF_EXPERTS, NO_GGUF_LAYER
from workers.contract.gguf_rule import GGUF_PACKED, gguf_kind
from workers.contract.mxfp4_rule import MXFP4_DEQUANTIZED, mxfp4_kind

NO_QUANTIZE = "no `--quantize fp8`: the projections keep the checkpoint's dtype"
NO_LORA = "LoRA adapters (`hetserve serve --lora`) are not part of a plan: the delta runs only with adapters"
NOT_STORED = {"fp8": "the checkpoint stores no fp8 weights", "int4": "the checkpoint stores no 4-bit weights",
              "mxfp4": "the checkpoint stores no MXFP4 experts"}


def stored_kind(quantization: dict | None) -> str | None:
    """What a pre-quantized checkpoint stores: `fp8`, `int4` or `mxfp4`; None when it is not one."""
    if quantization is None:
        return None
    if quantization.get("method") == "mxfp4":
        return "mxfp4"
    return "int4" if quantization.get("bits") == 4 else "fp8"


def unused_layers(described: dict, device_type: str, capability: str | None, quantize: str = "none") -> dict[str, str]:
    """The kernel layers absent from the described model on this device, each with why."""
    unused = dict(described["kernel_layers_unused"])  # what the architecture lacks (the workers' reading)
    quantization = described.get("quantization")
    kind = stored_kind(quantization)
    if quantize != "fp8":
        unused["Fp8Linear"] = NO_QUANTIZE
    if kind != "fp8":
        unused["Fp8CheckpointLinear"] = unused["Fp8FusedMoE"] = NOT_STORED["fp8"]
    elif "FusedMoE" in unused:  # a dense fp8 checkpoint: no experts to hold in fp8
        unused["Fp8FusedMoE"] = unused["FusedMoE"]
    if kind != "int4":
        unused["Int4CheckpointLinear"] = NOT_STORED["int4"]
    unused["LoraDelta"] = NO_LORA
    if not (described.get("gguf") and gguf_kind(device_type, capability) == GGUF_PACKED):
        unused["GGUFLinear"] = NO_GGUF_LAYER  # no GGUF file, or one this device dequantizes at load
    if "GGUFLinear" in unused or "FusedMoE" in unused:  # the GGUF layers' or the experts' absence
        unused["GGUFExperts"] = NO_GGUF_EXPERTS
    if kind != "mxfp4":
        unused["Mxfp4FusedMoE"] = NOT_STORED["mxfp4"]
    elif mxfp4_kind(device_type, capability) == MXFP4_DEQUANTIZED:
        unused["Mxfp4FusedMoE"] = "this device widens the MXFP4 experts at load; FusedMoE runs them"
    elif not any("expert" in name for name in quantization.get("ignore", ())):
        unused.setdefault("FusedMoE", "the MXFP4 experts stay packed on this device; Mxfp4FusedMoE runs them")
    return unused
