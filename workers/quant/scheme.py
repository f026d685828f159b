"""What one checkpoint's quantization says, as values: the fp8 scheme of a layer, and which layer gets which.

Design: a method module reads its config into one `QuantConfig`: config groups of (targets,
`Fp8Scheme`) and an `ignore` list, matched as compressed-tensors matches them (a module class
name such as `Linear`, an exact module name, or `re:` and a regular expression from the start of
the name); `scheme_for(name)` is the one place that answers "is this layer quantized, and how".
The schemes are those the execution layers run: e4m3 weights with per-tensor, per-channel or
128 x 128 block scales, activations per token, per token group or static per tensor. Trade-off:
a scheme the layers could run but the list does not name (say, weight-only fp8) is refused rather
than guessed."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

WEIGHT_STRATEGIES = ("tensor", "channel", "block")
ACTIVATIONS = ("dynamic_token", "dynamic_group", "static_tensor")
SUPPORTED_BLOCK = (128, 128)
SUPPORTED_SCHEMES = (
    "fp8 e4m3 weights per tensor or per channel, activations dynamic per token or static per tensor "
    "(`input_scale`)",
    f"fp8 e4m3 weights in {SUPPORTED_BLOCK[0]}x{SUPPORTED_BLOCK[1]} blocks, activations dynamic per "
    f"token group of {SUPPORTED_BLOCK[1]}",
)


class UnsupportedQuantizationError(ValueError):
    """A `quantization_config` (method, format or scheme) that no execution layer runs."""


def unsupported(what: str, value, allowed) -> UnsupportedQuantizationError:
    """`Unsupported <what> `<value>`. Supported: <allowed>` (allowed: strings or one sentence)."""
    shown = allowed if isinstance(allowed, str) else "; ".join(str(a) for a in allowed)
    return UnsupportedQuantizationError(f"Unsupported {what} `{value}`. Supported: {shown}")


@dataclass(frozen=True)
class Fp8Scheme:
    """One layer's fp8 scheme: weight scale granularity, activation quantization, the tensors it stores."""

    weights: str  # "tensor" | "channel" | "block"
    activations: str  # "dynamic_token" | "dynamic_group" | "static_tensor"
    block: tuple[int, int] | None = None  # (rows, cols) of a weight block; None unless "block"
    scale_name: str = "weight_scale"  # "weight_scale_inv" in the block-wise fp8 format (a multiplier all the same)

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_STRATEGIES:
            raise unsupported("fp8 weight strategy", self.weights, WEIGHT_STRATEGIES)
        if self.activations not in ACTIVATIONS:
            raise unsupported("fp8 activation scheme", self.activations, ACTIVATIONS)
        if (self.weights == "block") != (self.block is not None):
            raise unsupported("fp8 block structure", self.block, SUPPORTED_SCHEMES)
        if self.block is not None and tuple(self.block) != SUPPORTED_BLOCK:
            raise unsupported("fp8 weight block", list(self.block), [list(SUPPORTED_BLOCK)])
        if (self.weights == "block") != (self.activations == "dynamic_group"):
            raise unsupported(f"fp8 scheme of `{self.weights}` weights with `{self.activations}` activations",
                              f"{self.weights}/{self.activations}", SUPPORTED_SCHEMES)

    @property
    def act_group(self) -> int | None:
        """Columns per activation scale when quantized per token group (the weight block's width)."""
        return self.block[1] if self.block is not None else None

    @property
    def tensors(self) -> tuple[str, ...]:
        """The leaf names a quantized layer stores beside `weight`."""
        return (self.scale_name, *(("input_scale",) if self.activations == "static_tensor" else ()))

    def describe(self) -> str:
        w = {"tensor": "one scale per tensor", "channel": "one scale per output channel",
             "block": f"one scale per {self.block[0]}x{self.block[1]} block" if self.block else ""}[self.weights]
        a = {"dynamic_token": "activations quantized per token at run time",
             "dynamic_group": f"activations quantized per token and {self.act_group} columns at run time",
             "static_tensor": "activations quantized with the checkpoint's static per-tensor `input_scale`"}
        return f"fp8 e4m3 weights, {w}; {a[self.activations]}"


def matches(name: str, target: str, module_class: str = "Linear") -> bool:
    """compressed-tensors' rule: a class name, an exact module name, or `re:` + a regex matched at the start."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target in (name, module_class)


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's quantization: the method, its format, config groups and what it leaves alone."""

    method: str  # the registry's name ("compressed-tensors", "fp8")
    format: str  # "float-quantized", "block-wise", "per-tensor"
    groups: tuple[tuple[tuple[str, ...], Fp8Scheme], ...]  # (targets, scheme), first match wins
    ignore: tuple[str, ...] = ()
    ignore_rule: str = "compressed-tensors"  # how an ignore entry matches: "compressed-tensors" | "module"
    notes: tuple[str, ...] = field(default=())  # what the reader decided beyond the config's words

    def ignored(self, name: str) -> bool:
        """Whether `name` (a module of the checkpoint, `model.layers.0.mlp.down_proj`) is left unquantized."""
        if self.ignore_rule == "module":  # the HF / vLLM lists: a module name, or a path component of one
            return any(p.startswith("re:") and matches(name, p, "") or name == p or name.startswith(p + ".")
                       or name.endswith("." + p) or ("." + p + ".") in name for p in self.ignore)
        return any(matches(name, p, "") for p in self.ignore)

    def scheme_for(self, name: str, module_class: str = "Linear") -> Fp8Scheme | None:
        """The scheme of the checkpoint's module `name`, or None when it is not quantized."""
        if self.ignored(name):
            return None
        for targets, scheme in self.groups:
            if any(matches(name, t, module_class) for t in targets):
                return scheme
        return None

    def describe(self) -> dict:
        """`/workers` and `hetserve plan --model`: method, format, schemes by targets, ignore list."""
        return {"method": self.method, "format": self.format,
                "schemes": [{"targets": list(t), "scheme": s.describe(), "weights": s.weights,
                             "activations": s.activations, "block": list(s.block) if s.block else None}
                            for t, s in self.groups],
                "ignore": list(self.ignore), "notes": list(self.notes)}
