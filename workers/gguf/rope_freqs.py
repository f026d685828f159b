"""A GGUF's `rope_freqs` tensor read back as the Llama 3 rope scaling it was written from.

Design: llama.cpp's converter does not write Llama 3's rope scaling as metadata; it writes the
per-frequency divisors `rope_freqs` [head_dim / 2] that the scaling implies (1 for short
wavelengths, `factor` for long ones, between them `1 / ((1 - s) / factor + s)` with `s` linear in
the frequency). Those divisors fix `factor` (the largest) and the line `s = A * freq - B`; the
scaling's three other parameters are one point on that line, so we take llama.cpp's and Meta's
`low_freq_factor` 1 (then `high_freq_factor = 1 + 1 / B`, `original_max_position_embeddings =
2 pi A / B`), which gives the released models' own values. The parameters are accepted only when
the converter's formula gives the file's divisors back (relative error `TOLERANCE`); otherwise, or
with fewer than two frequencies between the bands, the file is refused by name. Torch-free (numpy),
run when the file is prepared. Trade-off: an exotic scaling that only `rope_freqs` could express is
refused rather than served through a generic divisor table.
"""

from __future__ import annotations

import math

import numpy as np

from workers.gguf.files import GGUFError

TOLERANCE = 1e-5


def llama3_factors(theta: float, dim: int, factor: float, low: float, high: float, old_len: float) -> np.ndarray:
    """The divisors llama.cpp's converter writes for a Llama 3 scaling (float32 [dim / 2])."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for freq in freqs.astype(np.float64):
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def llama3_from_rope_freqs(values: np.ndarray, theta: float, dim: int) -> dict | None:
    """The Llama 3 rope parameters that `values` (the file's `rope_freqs`) encode; None when every divisor is 1
    (no scaling). `GGUFError` when they fit no Llama 3 scaling."""
    r = np.asarray(values, dtype=np.float64).reshape(-1)
    if r.shape[0] != dim // 2:
        raise GGUFError(f"GGUF tensor `rope_freqs.weight` has {r.shape[0]} values; the head of {dim} has {dim // 2} "
                        "frequencies")
    if np.allclose(r, 1.0):
        return None
    factor = float(r.max())
    medium = (r > 1 + 1e-6) & (r < factor * (1 - 1e-6))
    if factor <= 1 or medium.sum() < 2:
        raise GGUFError("Unsupported GGUF tensor `rope_freqs.weight`: its divisors do not determine a Llama 3 rope "
                        "scaling (fewer than two frequencies between its bands). Supported: Llama 3 scaling "
                        "written by llama.cpp's converter, and rope scaling from metadata")
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)).astype(np.float64)
    smooth = (1 / r[medium] - 1 / factor) / (1 - 1 / factor)
    a, b = np.polyfit(freqs[medium], smooth, 1)  # smooth = a * freq - (-b)
    if -b > 0:
        fit_high, fit_len = float(1 + 1 / -b), float(2 * math.pi * a / -b)
        for high, old_len in ((round(fit_high, 4), round(fit_len)), (fit_high, fit_len)):  # a config's round values
            back = llama3_factors(theta, dim, factor, 1.0, high, old_len)
            if np.allclose(back, r, rtol=TOLERANCE, atol=0):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": high,
                        "original_max_position_embeddings": old_len}
    raise GGUFError("Unsupported GGUF tensor `rope_freqs.weight`: its divisors fit no Llama 3 rope scaling. "
                    "Supported: Llama 3 scaling written by llama.cpp's converter, and rope scaling from metadata")
