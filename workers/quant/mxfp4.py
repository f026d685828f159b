"""MXFP4 checkpoints (`quant_method: mxfp4`): gpt-oss's experts in OCP microscaling 4-bit floats.

Design: `read(qc)` turns the config into an `Mxfp4Config`: only the stacked experts are quantized,
as `P_blocks` (two e2m1 codes a byte, 32 inputs a block) and `P_scales` (a block's e8m0 exponent),
and `modules_to_not_convert` is matched as transformers matches it. A weight is its code's value
(`e2m1_values`, from the format's definition) times its block's scale, exact in fp32 and rounded
once to the model dtype; the dequantized projection [E, N, K] is the transpose of gpt-oss's
unquantized tensor, so the family's own map places it. Any other config key is refused by name.
`mxfp4_execution` is the device rule with its reason (workers/contract/mxfp4_rule.py): CUDA from
sm_80 and ROCm keep the experts packed (`w4a16`), the others dequantize them at load. The format
in full: docs/quantization-mxfp4.md. Trade-off: a dequantizing device holds the experts widened,
in exchange for computing with the reference weights exactly."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from workers.contract.capability import Capability
from workers.contract.mxfp4_rule import MXFP4_CAPABILITY, MXFP4_W4A16, mxfp4_kind
from workers.quant.scheme import unsupported

NAME = "mxfp4"
FORMAT = "e2m1 with e8m0 scales per 32"
BLOCK = 32  # values per scale
SCALE_BIAS = 127  # e8m0: scale = 2^(stored - 127)
SCALE_NAN = 255  # e8m0's one NaN encoding
KEYS = ("quant_method", "modules_to_not_convert", "dequantize")  # `dequantize`: transformers' load option
LEAVES = ("_blocks", "_scales")  # `P_blocks`, `P_scales` beside a projection `P`


class Mxfp4TensorError(ValueError):
    """An MXFP4 projection's stored tensors are not what the format stores (dtype, shape, a NaN scale)."""


def e2m1_values(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 e2m1 values by code: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0."""
    out = []
    for code in range(16):
        sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
        mag = man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1)  # exp 0: subnormal (0 or 0.5)
        out.append(-mag if sign else mag)
    return torch.tensor(out, dtype=dtype)


def unpack_codes(blocks: torch.Tensor) -> torch.Tensor:
    """[..., G, 16] uint8 -> [..., G, 32] int64 codes in [0, 15]: low nibble first in each byte."""
    b = blocks.to(torch.int64)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


def block_scales(scales: torch.Tensor) -> torch.Tensor:
    """e8m0 exponents [...] uint8 -> the fp32 scales 2^(s - 127), built from their bits (exact, 2^-127 too)."""
    s = scales.to(torch.int32)
    normal = (s << 23).view(torch.float32)  # biased exponent field s, mantissa 0: exactly 2^(s - 127)
    return torch.where(s == 0, torch.tensor(2.0**-127), normal)  # s = 0: fp32's subnormal 2^-127


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[..., N, G, 16] blocks and [..., N, G] scales -> [..., N, G * 32] weights in `dtype` (one rounding)."""
    values = e2m1_values(torch.float32).to(blocks.device)[unpack_codes(blocks)]  # [..., N, G, 32]
    w = values * block_scales(scales).to(blocks.device)[..., None]  # exact in fp32
    return w.flatten(-2).to(dtype)


def check_stored(name: str, blocks: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...]) -> None:
    """`Mxfp4TensorError` unless `name`'s blocks and scales are the format's for a dequantized [E, N, K] `shape`."""
    e, n, k = shape
    if k % BLOCK:
        raise Mxfp4TensorError(f"`{name}` has {k} inputs per output; MXFP4 stores whole blocks of {BLOCK}")
    want = {"_blocks": (e, n, k // BLOCK, BLOCK // 2), "_scales": (e, n, k // BLOCK)}
    for leaf, t in (("_blocks", blocks), ("_scales", scales)):
        if t.dtype != torch.uint8:
            raise Mxfp4TensorError(f"`{name}{leaf}` is `{t.dtype}`; MXFP4 stores `torch.uint8`")
        if tuple(t.shape) != want[leaf]:
            raise Mxfp4TensorError(
                f"`{name}{leaf}` has shape {tuple(t.shape)}; the config expects "
                f"{list(want[leaf])} (experts, outputs, blocks of {BLOCK} inputs"
                f"{', bytes' if leaf == '_blocks' else ''})"
            )
    if bool((scales == SCALE_NAN).any()):
        raise Mxfp4TensorError(
            f"`{name}_scales` holds {SCALE_NAN}, e8m0's NaN; a scale is an exponent 0..254"
        )


def _not_converted(name: str, pattern: str) -> bool:
    """transformers' rule: `pattern` as a regex from the start up to a module boundary, or a suffix."""
    try:
        hit = re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", name) is not None
    except re.error:  # not a regex: a literal module name
        hit = name == pattern or name.startswith(pattern + ".")
    return hit or name.endswith(pattern)


@dataclass(frozen=True)
class Mxfp4Config:
    """An MXFP4 checkpoint's quantization: the experts' projections in e2m1, what it leaves alone."""

    ignore: tuple[str, ...] = ()  # `modules_to_not_convert`
    method: str = NAME
    format: str = FORMAT
    notes: tuple[str, ...] = field(default=())

    def ignored(self, module: str) -> bool:
        """Whether `module` (`model.layers.0.mlp.experts`) is left unquantized by the config."""
        return any(_not_converted(module, p) for p in self.ignore)

    def describe(self) -> dict:
        """`/workers` and `hetserve plan --model`: method, format, scheme, ignore list."""
        return {
            "method": self.method,
            "format": self.format,
            "bits": 4,
            "schemes": [
                {
                    "targets": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                    "scheme": f"e2m1 weights in blocks of {BLOCK} inputs with one e8m0 scale each "
                    f"(2^(s - {SCALE_BIAS})); biases in the model dtype",
                    "layout": "mxfp4",
                    "group_size": BLOCK,
                }
            ],
            "ignore": list(self.ignore),
            "notes": list(self.notes),
            **mxfp4_execution(None).to_dict(),  # one rule for every device (a worker names its own)
        }


def read(qc: dict) -> Mxfp4Config:
    """The `Mxfp4Config` of a `quant_method: mxfp4` config; `UnsupportedQuantizationError` otherwise."""
    extra = sorted(k for k in qc if k not in KEYS)
    if extra:
        raise unsupported("MXFP4 `quantization_config` key", ", ".join(extra), [f"`{k}`" for k in KEYS])
    ignore = qc.get("modules_to_not_convert") or ()
    if isinstance(ignore, str) or not all(isinstance(p, str) for p in ignore):
        raise unsupported("MXFP4 `modules_to_not_convert`", ignore, ["a list of module names or patterns"])
    if not isinstance(qc.get("dequantize", False), bool):
        raise unsupported("MXFP4 `dequantize`", qc["dequantize"], ["true", "false"])
    return Mxfp4Config(tuple(ignore))


@dataclass(frozen=True)
class Mxfp4Execution:
    kind: str  # "w4a16" | "dequantized" (workers/contract/mxfp4_rule.py)
    reason: str

    def to_dict(self) -> dict:
        return {"execution": self.kind, "reason": self.reason}


RULE = (
    f"MXFP4 experts kept packed on CUDA from {MXFP4_CAPABILITY.sm} and on ROCm (e2m1 decoded in registers "
    "inside the Triton grouped GEMM), dequantized to the model dtype at load below and on the CPU"
)


def mxfp4_execution(device_type: str | None, capability: tuple[int, int] | None = None) -> Mxfp4Execution:
    """How this device runs MXFP4 experts, and why (`device_type` None: the rule, per device)."""
    if device_type is None:
        return Mxfp4Execution("per device", RULE)
    kind = mxfp4_kind(device_type, capability)
    if device_type == "cpu":
        return Mxfp4Execution(kind, "CPU: MXFP4 experts dequantized to the model dtype at load (Triton needs a GPU); "
                                    "they take the widened bytes")  # fmt: skip
    where = (
        "ROCm"
        if device_type == "rocm"
        else ("unknown capability" if capability is None else Capability.parse(capability).sm)
    )
    if kind == MXFP4_W4A16:
        return Mxfp4Execution(kind, f"{where}: MXFP4 experts kept packed (4.25 bits a weight), e2m1 decoded in "
                                    "registers inside the Triton grouped GEMM, 16-bit tensor cores")  # fmt: skip
    return Mxfp4Execution(kind, f"{where}: below {MXFP4_CAPABILITY.sm} the fused MoE's grouped GEMM does not run in "
                                "Triton (its dots lower to FMAs): MXFP4 experts dequantized to the model dtype at "
                                "load; they take the widened bytes")  # fmt: skip
