"""The compute dtype a device loads a checkpoint in (`--dtype auto`), as names, without torch.

Design: the rule is a pure function of (requested dtype, the checkpoint's dtype, the compute
device's type, its capability) returning the dtype's name and the reason, so the router's
placement (server/fleet/placement.py) sizes a model's weights on each device with the same
answer the worker's loader (`workers/model/loader.py` `choose_dtype()`, which maps the name
to a torch dtype) arrives at. Trade-off: names, not torch dtypes, so that the contract stays
torch-free; `DTYPE_BYTES` is the one table of element sizes both sides use.
"""

from __future__ import annotations

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
DTYPE_CHOICES = ("auto", *DTYPE_BYTES)
# safetensors' dtype names -> bytes per element (the header's `dtype` field)
SAFETENSORS_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 0.5,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
SAFETENSORS_FLOATS = frozenset({"F64", "F32", "F16", "BF16"})  # loaded in the compute dtype


class DtypeError(ValueError):
    """A `--dtype` that is not one of `DTYPE_CHOICES`."""


def dtype_rule(requested: str, checkpoint_dtype: str | None, device_type: str,
               capability: tuple[int, int] | None = None) -> tuple[str, str]:
    """(dtype name, reason). `auto` keeps the checkpoint's dtype where the device computes it well."""
    if requested not in DTYPE_CHOICES:
        raise DtypeError(f"Unsupported dtype `{requested}`. Supported: {', '.join(DTYPE_CHOICES)}")
    if requested != "auto":
        return requested, f"requested {requested}"
    saved = checkpoint_dtype if checkpoint_dtype in DTYPE_BYTES else None
    if device_type == "cpu":
        if saved in ("bfloat16", "float32"):
            return saved, f"auto: checkpoint is {saved}, which CPU matmuls support natively"
        if saved == "float16":
            return "float32", ("auto: checkpoint is float16; CPU float16 matmuls are slow and bfloat16 would "
                               "round its weights, so float32")
        return "float32", "auto: checkpoint dtype unknown; float32 on CPU"
    bf16_ok = capability is None or tuple(capability) >= (8, 0)
    if saved in ("bfloat16", "float16") and (saved == "float16" or bf16_ok):
        return saved, f"auto: checkpoint is {saved}"
    if bf16_ok:
        return "bfloat16", f"auto: checkpoint is {saved or 'unspecified'}; bfloat16 on a GPU with native bf16"
    return "float16", f"auto: checkpoint is {saved or 'unspecified'}; float16 (no native bf16 below sm_80)"
