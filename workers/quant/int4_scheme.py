"""What a 4-bit checkpoint's quantization says, as values: a layer's int4 scheme, and which layer gets which.

Design: the three 4-bit readers (`gptq.py`, `awq.py`, `pack_quantized.py`) each turn their config
into one `Int4Config` of (targets, `Int4Scheme`) groups and an ignore list, matched as the fp8
`QuantConfig` matches them (its `ignored` and `scheme_for` reused). An `Int4Scheme` names the
stored layout (`gptq`, `awq`, `pack-quantized`), the group size (-1: per output channel), whether
zero points are stored and the offset the format adds to them. Trade-off: the only bit width is 4
and the only group sizes 32, 64 and 128 (or per channel); anything else is refused by name, since
no layer here would run it."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.quant.scheme import QuantConfig, unsupported

BITS = (4,)
GROUP_SIZES = (32, 64, 128, -1)  # -1: per output channel (one group over the whole input)
LAYOUTS = ("gptq", "awq", "pack-quantized")
# the leaves each layout stores beside (or instead of) `weight`
LEAVES = {"gptq": ("qweight", "qzeros", "scales", "g_idx"),
          "awq": ("qweight", "qzeros", "scales"),
          "pack-quantized": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")}
PACKED = {"gptq": "qweight", "awq": "qweight", "pack-quantized": "weight_packed"}  # the leaf that marks a 4-bit layer


def check_bits(bits, what: str) -> int:
    if bits not in BITS:
        raise unsupported(f"{what} bits", bits, [str(b) for b in BITS])
    return bits


def check_group(group, what: str, allowed: tuple[int, ...] = GROUP_SIZES) -> int:
    if group not in allowed:
        raise unsupported(f"{what} group size", group,
                          [f"{g}" + (" (per channel)" if g == -1 else "") for g in allowed])
    return group


@dataclass(frozen=True)
class Int4Scheme:
    """One layer's 4-bit scheme: the stored layout, the group size, zero points and their convention."""

    layout: str  # "gptq" | "awq" | "pack-quantized"
    group_size: int  # 32 | 64 | 128 | -1 (per channel)
    symmetric: bool  # as the config says; GPTQ and AWQ store zero points either way (8 when symmetric)
    zero_points: bool = True  # zero points stored (`qzeros`, `weight_zero_point`); pack-quantized symmetric: none
    zero_offset: int = 0  # added to a stored zero point: 1 in GPTQ's v1 `gptq` format, else 0
    desc_act: bool = False  # GPTQ's act-order: `g_idx` gives each input column its group
    bits: int = 4

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise unsupported("4-bit layout", self.layout, LAYOUTS)
        check_bits(self.bits, f"{self.layout}")
        check_group(self.group_size, f"{self.layout}")

    @property
    def leaves(self) -> tuple[str, ...]:
        return LEAVES[self.layout]

    @property
    def packed(self) -> str:
        return PACKED[self.layout]

    def groups(self, in_features: int) -> int:
        """Scale rows (GPTQ, AWQ) or columns (pack-quantized) of a layer with `in_features` inputs."""
        return 1 if self.group_size == -1 else -(-in_features // self.group_size)

    def describe(self) -> str:
        group = "per output channel" if self.group_size == -1 else f"groups of {self.group_size} inputs"
        zeros = ("symmetric" if self.symmetric else "asymmetric (stored zero points)")
        extra = {"gptq": f"GPTQ layout ({'v1: zero points stored minus 1' if self.zero_offset else 'v2 zero points'}"
                         f"{', act-order g_idx' if self.desc_act else ''})",
                 "awq": "AWQ GEMM layout (interleaved nibbles 0,2,4,6,1,3,5,7)",
                 "pack-quantized": "compressed-tensors pack-quantized layout (values offset by 8)"}[self.layout]
        return f"int{self.bits} weights, {group}, {zeros}; {extra}; activations in the model dtype"


@dataclass(frozen=True)
class Int4Config:
    """A 4-bit checkpoint's quantization: method, format, config groups and what it leaves alone."""

    method: str  # "gptq" | "awq" | "compressed-tensors"
    format: str  # "gptq" | "gptq_v2" | "gemm" | "pack-quantized"
    groups: tuple[tuple[tuple[str, ...], Int4Scheme], ...]  # (targets, scheme), first match wins
    ignore: tuple[str, ...] = ()
    ignore_rule: str = "module"  # "module": HF's `modules_to_not_convert`; "compressed-tensors": its `ignore`
    notes: tuple[str, ...] = field(default=())

    ignored = QuantConfig.ignored  # the same matching as the fp8 configs: one rule for every method
    scheme_for = QuantConfig.scheme_for

    def describe(self) -> dict:
        """`/workers` and `hetserve plan --model`: method, format, schemes by targets, ignore list."""
        return {"method": self.method, "format": self.format, "bits": 4,
                "schemes": [{"targets": list(t), "scheme": s.describe(), "layout": s.layout,
                             "group_size": s.group_size, "symmetric": s.symmetric, "desc_act": s.desc_act}
                            for t, s in self.groups],
                "ignore": list(self.ignore), "notes": list(self.notes)}


def module_ignore(qc: dict, *keys: str) -> tuple[str, ...]:
    """HF's not-converted modules (`modules_to_not_convert` or another key), `lm_head` always among them
    unless the config quantizes it (GPTQ's `lm_head: true`)."""
    names: list[str] = []
    for key in keys:
        names += list(qc.get(key) or ())
    if not qc.get("lm_head"):
        names.append("lm_head")
    return tuple(dict.fromkeys(names))
