"""AWQ checkpoints (`quant_method: awq`, AutoAWQ's GEMM version).

Design: `read(qc)` turns the config into an `Int4Config` whose one group targets every linear
layer but `lm_head` and `modules_to_not_convert`; the stored layout (`qweight` packed along the
output dim in AWQ's interleaved nibble order, `qzeros` likewise, `scales` as stored) and every
refusal: docs/quantization-int4.md. Trade-off: AutoAWQ's older key spellings (`w_bit`,
`q_group_size`) are read too, so checkpoints of either era load."""

from __future__ import annotations

from workers.quant.int4_scheme import Int4Config, Int4Scheme, check_bits, check_group, module_ignore
from workers.quant.scheme import unsupported

NAME = "awq"
VERSIONS = ("gemm",)


def read(qc: dict) -> Int4Config:
    """The `Int4Config` of an AWQ `quantization_config`; `UnsupportedQuantizationError` otherwise."""
    check_bits(qc.get("bits", qc.get("w_bit")), "AWQ")
    group = check_group(qc.get("group_size", qc.get("q_group_size", 128)), "AWQ", (32, 64, 128))
    version = str(qc.get("version", "gemm")).lower()
    if version not in VERSIONS:
        raise unsupported("AWQ `version`", qc.get("version"), VERSIONS)
    if qc.get("zero_point", True) is not True:
        raise unsupported("AWQ `zero_point`", qc.get("zero_point"), ["true"])
    scheme = Int4Scheme("awq", group, symmetric=False, zero_points=True)
    return Int4Config(NAME, version, ((("Linear",), scheme),), module_ignore(qc, "modules_to_not_convert"))
