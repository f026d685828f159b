"""Rotary position embeddings (RoPE), default, linear and llama3 scaling.

Design: the model keeps no rope buffers. Tables are computed on first use per device and
grown by doubling, so a model built on the meta device and loaded with
`load_state_dict(assign=True)` needs no extra initialisation step, and a 128k-context
config does not allocate its whole table up front. Frequencies follow transformers'
`rotate_half` (non-interleaved) layout in fp32, so Hugging Face q/k weights load
unpermuted and the rotation matches theirs bit for bit.
"""

from __future__ import annotations

import math

import torch

from workers.model.config import ModelConfig


def inv_frequencies(config: ModelConfig) -> torch.Tensor:
    """[D/2] fp32 inverse frequencies, with the config's rope scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type != "llama3":
        return inv_freq
    # llama3: long wavelengths slowed by `factor`, short kept, the band between interpolated.
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryTables:
    """cos/sin tables `[S, D/2]` fp32 per device, grown on demand."""

    def __init__(self, config: ModelConfig) -> None:
        self.inv_freq = inv_frequencies(config)  # [D/2] fp32, CPU
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, device: torch.device, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._tables.get(device)
        if cached is None or cached[0].shape[0] < length:
            size = max(256, 1 << (length - 1).bit_length())
            pos = torch.arange(size, dtype=torch.float32, device="cpu")
            freqs = torch.outer(pos, self.inv_freq)  # [S, D/2]
            cached = (freqs.cos().to(device), freqs.sin().to(device))
            self._tables[device] = cached
        return cached

    def lookup(
        self, positions: torch.Tensor, max_pos: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` ([T] or [S]) -> each [T, 1, D/2] in `dtype`."""
        cos, sin = self._table(positions.device, max_pos + 1)
        return cos[positions].to(dtype).unsqueeze(-2), sin[positions].to(dtype).unsqueeze(-2)

    def lookup_range(self, length: int, device: torch.device, dtype: torch.dtype):
        """cos, sin for positions 0..length-1 -> each [S, 1, D/2]."""
        cos, sin = self._table(device, length)
        return cos[:length].to(dtype).unsqueeze(-2), sin[:length].to(dtype).unsqueeze(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [..., T, heads, D] by cos/sin [T, 1, D/2] (rotate_half layout)."""
    x1, x2 = x.chunk(2, dim=-1)  # [..., T, heads, D/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
