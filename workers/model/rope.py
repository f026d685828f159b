"""Rotary position embeddings: every rope type transformers names, over all or part of a head.

Design: one frozen `RopeSpec` per kind of layer (`default`, `linear`, `dynamic`, `yarn`,
`longrope`, `llama3`, `proportional`; partial rotary through `rotary_dim`; no spec for a NoPE
layer) and `RotaryTables` that turn positions into cos/sin. Tables are computed on first use per
device and grown by doubling, so a meta-built model needs no initialisation and a 128k context
allocates nothing up front. Frequencies follow transformers' non-interleaved `rotate_half`
layout in fp32, so Hugging Face q/k weights load unpermuted and rotate bit for bit as theirs.
`dynamic` and `longrope` depend on a sequence length: each token is rotated for
`max(position + 1, prompt length)`, so a prompt rotates as one forward over it would however it is
chunked, and each generated token as its own decode step would (transformers' `generate`); the
prefix cache keys such blocks by that length. Trade-off: a resumed stream's replayed tokens rotate
as one prompt, so past the switch they differ from the original's step-by-step rotation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kernels_local.rotary import cpu as cpu_rotary
from workers.contract.checkpoint_check import ROPE_TYPES  # the router checks a checkpoint against it too

_LENGTH_DEPENDENT = ("dynamic", "longrope")


class RopeConfigError(ValueError):
    """A rope configuration this server cannot compute; the message names the field."""


@dataclass(frozen=True)
class RopeSpec:
    """The rotary embedding of one kind of layer (hashable: layers with equal specs share tables)."""

    rope_type: str = "default"
    theta: float = 10000.0
    rotary_dim: int = 64  # the first `rotary_dim` dimensions of a head rotate; the rest pass through
    max_position: int = 2048  # `max_position_embeddings`: dynamic scaling's reference length
    params: tuple[tuple[str, Any], ...] = ()  # the type's parameters (factor, long_factor, ...), sorted

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise RopeConfigError(f"Unsupported rope type `{self.rope_type}`. Supported: {', '.join(ROPE_TYPES)}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise RopeConfigError(f"The rotary dimension must be even and >= 2, got `{self.rotary_dim}`")

    def get(self, name: str, default=None):
        return dict(self.params).get(name, default)

    @property
    def rotated_dims(self) -> int:
        """Dimensions of a head that rotate: `rotary_dim`, or twice a proportional rotary's angles."""
        return 2 * int(self.get("rope_angles")) if self.rope_type == "proportional" else self.rotary_dim

    @property
    def threshold(self) -> int | None:
        """The length past which a token's rotation changes (dynamic, longrope), else None."""
        if self.rope_type == "dynamic":
            return self.max_position
        if self.rope_type == "longrope":
            return int(self.get("original_max_position_embeddings"))
        return None

    @classmethod
    def create(cls, params: dict[str, Any], head_dim: int, max_position: int) -> RopeSpec:
        """From one rope parameter dict in transformers 5's standard form (`rope_type`, `rope_theta`,
        `partial_rotary_factor` and the type's own keys)."""
        params = dict(params)
        rope_type = params.pop("rope_type", params.pop("type", "default"))
        theta = float(params.pop("rope_theta", 10000.0))
        partial = float(params.pop("partial_rotary_factor", 1.0) or 1.0)
        if not 0.0 < partial <= 1.0:
            raise RopeConfigError(f"`partial_rotary_factor` must be in (0, 1], got `{partial}`")
        needs = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("original_max_position_embeddings",),
                 "longrope": ("long_factor", "short_factor", "original_max_position_embeddings"),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
        missing = [k for k in needs.get(rope_type, ()) if params.get(k) is None]
        if missing:
            raise RopeConfigError(f"Rope type `{rope_type}` needs {', '.join(f'`{k}`' for k in missing)}")
        if rope_type == "proportional":  # the whole head, its angles past `partial` of a half left at 0
            params["rope_angles"] = int(partial * head_dim // 2)
            partial = 1.0
        frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))
        return cls(rope_type, theta, int(head_dim * partial), int(max_position), frozen)


def _default(spec: RopeSpec, base: float | None = None) -> torch.Tensor:
    dim = spec.rotary_dim
    base = spec.theta if base is None else base
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def _llama3(spec: RopeSpec) -> torch.Tensor:
    # long wavelengths slowed by `factor`, short kept, the band between interpolated
    inv_freq = _default(spec)
    factor = float(spec.get("factor"))
    low, high = float(spec.get("low_freq_factor")), float(spec.get("high_freq_factor"))
    old_len = float(spec.get("original_max_position_embeddings"))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    dim, base = spec.rotary_dim, spec.theta
    original = spec.get("original_max_position_embeddings")
    factor = spec.get("factor") or spec.max_position / original
    attention_factor = spec.get("attention_factor")

    def mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        m, m_all = spec.get("mscale"), spec.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = spec.get("beta_fast") or 32, spec.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if spec.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope(spec: RopeSpec, long: bool) -> tuple[torch.Tensor, float]:
    dim = spec.rotary_dim
    original = spec.get("original_max_position_embeddings")
    factor = spec.get("factor") or spec.max_position / original
    attention_factor = spec.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(spec.get("long_factor" if long else "short_factor"), dtype=torch.float32)
    if ext.shape[0] != dim // 2:
        raise RopeConfigError(f"LongRoPE factors need {dim // 2} entries (rotary dim {dim}), got {ext.shape[0]}")
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * spec.theta**shape), float(attention_factor)


def _proportional(spec: RopeSpec) -> torch.Tensor:
    """Gemma 4: `rope_angles` frequencies `theta ** (-2j / D)` over the whole head dim D, then zeros.

    Partial the other way round: it rotates the first angles of each half of the head (pairs
    `j, j + D/2`) and leaves the rest unrotated, as transformers computes it; the spec covers the
    whole head and the zero frequencies give cos 1, sin 0, so those dimensions pass through
    exactly, multiplied by 1 and 0 rather than skipped."""
    dim, angles = spec.rotary_dim, int(spec.get("rope_angles"))
    rotated = 1.0 / (spec.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / dim))
    return torch.cat((rotated, torch.zeros(dim // 2 - angles))) / float(spec.get("factor") or 1.0)


def _dynamic(spec: RopeSpec, seq_len: int) -> torch.Tensor:
    """NTK scaling for a sequence of `seq_len` tokens (the base table up to `max_position`)."""
    if seq_len <= spec.max_position:
        return _default(spec)
    factor, dim = float(spec.get("factor")), spec.rotary_dim
    base = spec.theta * ((factor * seq_len / spec.max_position) - (factor - 1)) ** (dim / (dim - 2))
    return _default(spec, base)


def inv_frequencies(spec: RopeSpec, variant: int = 0) -> tuple[torch.Tensor, float]:
    """([rotary_dim / 2] fp32 inverse frequencies, attention factor) of one table: LongRoPE's
    `variant` 1 is its long-factor table; dynamic's tables are per length (`_dynamic`). Each formula
    is `transformers.modeling_rope_utils`'s; yarn's and LongRoPE's attention factor scales cos and
    sin in fp32."""
    if spec.rope_type == "linear":
        return _default(spec) / float(spec.get("factor")), 1.0
    if spec.rope_type == "llama3":
        return _llama3(spec), 1.0
    if spec.rope_type == "yarn":
        return _yarn(spec)
    if spec.rope_type == "longrope":
        return _longrope(spec, long=variant == 1)
    if spec.rope_type == "proportional":
        return _proportional(spec), 1.0
    return _default(spec), 1.0


class RotaryTables:
    """cos/sin `[S, rotary_dim / 2]` fp32 per (spec, variant, device), grown on demand."""

    def __init__(self) -> None:
        self._inv: dict[tuple[RopeSpec, int], tuple[torch.Tensor, float]] = {}
        self._tables: dict[tuple[RopeSpec, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, spec: RopeSpec, variant: int, device: torch.device, length: int):
        key = (spec, variant, device)
        cached = self._tables.get(key)
        if cached is None or cached[0].shape[0] < length:
            if (spec, variant) not in self._inv:
                self._inv[(spec, variant)] = inv_frequencies(spec, variant)
            inv_freq, factor = self._inv[(spec, variant)]
            size = max(256, 1 << (length - 1).bit_length())
            freqs = torch.outer(torch.arange(size, dtype=torch.float32), inv_freq)  # [S, rot/2]
            cos, sin = freqs.cos(), freqs.sin()
            if factor != 1.0:
                cos, sin = cos * factor, sin * factor
            cached = self._tables[key] = (cos.to(device), sin.to(device))
        return cached

    def lookup(self, spec: RopeSpec, positions: torch.Tensor, max_pos: int, dtype: torch.dtype,
               lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [T] -> each [T, 1, rotary_dim / 2] in `dtype`. `lengths` [T]: the
        sequence length each token is rotated for (dynamic, longrope; see the module docstring)."""
        cos, sin = self._table(spec, 0, positions.device, max_pos + 1)
        threshold = spec.threshold
        # LongRoPE's choice is a per-token `where`, so a compiled step (no host reads) makes it
        # for every token; eager skips the long table when no token is past the threshold
        traced = spec.rope_type == "longrope" and torch.compiler.is_compiling()
        if threshold is None or lengths is None or (not traced and int(lengths.max()) <= threshold):
            return cos[positions].to(dtype).unsqueeze(-2), sin[positions].to(dtype).unsqueeze(-2)
        c, s = cos[positions], sin[positions]  # [T, rot/2] fp32
        past = lengths > threshold  # [T]
        if spec.rope_type == "longrope":
            lc, ls = self._table(spec, 1, positions.device, max_pos + 1)
            c = torch.where(past[:, None], lc[positions], c)
            s = torch.where(past[:, None], ls[positions], s)
        else:  # dynamic: one set of frequencies per distinct length past the threshold
            c, s = c.clone(), s.clone()
            for n in sorted(set(lengths[past].tolist())):
                rows = (lengths == n).nonzero().flatten()
                freqs = positions[rows].float()[:, None] * _dynamic(spec, int(n)).to(positions.device)[None, :]
                c[rows], s[rows] = freqs.cos(), freqs.sin()
        return c.to(dtype).unsqueeze(-2), s.to(dtype).unsqueeze(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [..., T, heads, D] by cos/sin [T, 1, R/2] (rotate_half layout) over its first R
    dimensions; the rest pass through (partial rotary). The rotary repository's form: an eager CPU
    step's packed tokens take its C++ kernel, which computes the same bits in one pass, everything
    else its torch reference (kernels_local/rotary/)."""
    return cpu_rotary.rotary_cpu(x, cos, sin)
