"""GPTQ checkpoints (`quant_method: gptq`: AutoGPTQ, GPTQModel, optimum).

Design: `read(qc)` turns the config into an `Int4Config` whose one group targets every linear
layer but `lm_head` (unless `lm_head: true`) and `modules_to_not_convert`. `checkpoint_format:
gptq` (v1, AutoGPTQ's) stores each zero point minus 1, `gptq_v2` (GPTQModel's) as is; the stored
tensors and every refusal: docs/quantization-int4.md. Trade-off: `sym` is reported, never assumed:
the stored zero points are used either way, as every GPTQ reference does."""

from __future__ import annotations

from workers.quant.int4_scheme import Int4Config, Int4Scheme, check_bits, check_group, module_ignore
from workers.quant.scheme import unsupported

NAME = "gptq"
CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}  # format -> the offset added to a stored zero point


def read(qc: dict) -> Int4Config:
    """The `Int4Config` of a GPTQ `quantization_config`; `UnsupportedQuantizationError` otherwise."""
    check_bits(qc.get("bits"), "GPTQ")
    group = check_group(qc.get("group_size", 128), "GPTQ")
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if fmt not in CHECKPOINT_FORMATS:
        raise unsupported("GPTQ `checkpoint_format`", fmt, list(CHECKPOINT_FORMATS))
    if qc.get("dynamic"):
        raise unsupported("GPTQ per-module `dynamic` overrides", qc["dynamic"], ["none (one scheme for every layer)"])
    sym, desc_act = bool(qc.get("sym", True)), bool(qc.get("desc_act", False))
    scheme = Int4Scheme("gptq", group, sym, zero_points=True, zero_offset=CHECKPOINT_FORMATS[fmt], desc_act=desc_act)
    return Int4Config(NAME, fmt, ((("Linear",), scheme),), module_ignore(qc, "modules_to_not_convert"))
