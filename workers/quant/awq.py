"""AWQ checkpoints (`quant_method: awq`, AutoAWQ's GEMM version).

Design: `read(qc)` turns `{"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true,
"version": "gemm", "modules_to_not_convert": [...]}` into an `Int4Config` whose one group targets
every linear layer but `lm_head` and the not-converted modules. A layer stores `qweight` int32
[in, out/8] packed along the output dim in AWQ's interleaved order (word nibble i holds output column
8c + [0, 2, 4, 6, 1, 3, 5, 7][i]), `qzeros` int32 [in/group, out/8] packed the same way and `scales`
[in/group, out] (fp16 as AutoAWQ writes it; bf16 and fp32 are used as stored too). The weight is
`(q - z) * s` per group of inputs; zero points are stored as they are (no offset). Refused by name:
bits other than 4, group sizes other than 32/64/128, `zero_point: false`, and the other versions
(gemv, gemv_fast, exllama, marlin, ipex), whose layouts differ. The trade-off: AutoAWQ's older key
spellings (`w_bit`, `q_group_size`) are read too, so checkpoints of either era load.
"""

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
