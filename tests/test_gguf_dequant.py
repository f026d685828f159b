"""Our GGUF dequantization equals gguf-py's `gguf.quants.dequantize` bit for bit, for every type we serve.

The packed bytes come from gguf-py's own quantizers where it has one (BF16, Q4_0..Q8_0, MXFP4);
for the K- and IQ-types, which gguf-py only dequantizes, random bytes with finite fp16 scales
(normal and subnormal) are a legitimate block for both dequantizers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

from workers.gguf.dequant import BLOCKS, TYPES, UnsupportedTensorType, dequantize  # noqa: E402

QUANTIZED_BY_GGUF = ("BF16", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4")
# byte offsets of each block's fp16 scales (d, dmin) in the types gguf-py cannot quantize
FP16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
               "IQ4_NL": (0,), "IQ4_XS": (0,)}


def _reference(raw: np.ndarray, name: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, T[name])))


def _random_blocks(name: str, rows: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of `rows` rows of two blocks, every fp16 scale finite (from 1e-7, subnormal, to 1e2)."""
    _, size = BLOCKS[name]
    raw = rng.integers(0, 256, size=(rows, 2, size), dtype=np.uint8)
    for offset in FP16_FIELDS[name]:
        scales = (rng.choice([-1, 1], size=(rows, 2)) * 10 ** rng.uniform(-7, 2, size=(rows, 2))).astype(np.float16)
        raw[..., offset:offset + 2] = scales.view(np.uint8).reshape(rows, 2, 2)
    return raw.reshape(rows, 2 * size)


def test_every_listed_type_has_a_case():
    """The cases below cover every type `dequantize` claims, so none is left unchecked."""
    assert set(QUANTIZED_BY_GGUF) | set(FP16_FIELDS) | {"F32"} == set(TYPES)


@pytest.mark.parametrize("name", QUANTIZED_BY_GGUF)
def test_equal_to_gguf_py_on_its_own_quantization(name):
    rng = np.random.default_rng(1)
    elements, _ = BLOCKS[name]
    values = (rng.standard_normal((8, 4 * max(elements, 32))) * 10 ** rng.uniform(-3, 1, size=(8, 1)))
    raw = gguf.quants.quantize(values.astype(np.float32), T[name])
    raw = raw.view(np.uint8)
    ref = _reference(raw, name) if name != "F16" else torch.from_numpy(raw.view(np.float16).astype(np.float32))
    ours = dequantize(torch.from_numpy(raw), name, tuple(ref.shape))
    assert ours.dtype == torch.float32 and torch.equal(ours, ref)


@pytest.mark.parametrize("name", sorted(FP16_FIELDS))
def test_equal_to_gguf_py_on_random_blocks(name):
    raw = _random_blocks(name, 16, np.random.default_rng(2))
    ref = _reference(raw, name)
    ours = dequantize(torch.from_numpy(raw), name, tuple(ref.shape))
    assert torch.isfinite(ref).all()
    assert torch.equal(ours, ref)


def test_f32_is_its_bytes():
    values = np.random.default_rng(3).standard_normal((3, 8)).astype(np.float32)
    ours = dequantize(torch.from_numpy(values.view(np.uint8)), "F32", (3, 8))
    assert torch.equal(ours, torch.from_numpy(values))


def test_unsupported_type_is_named_with_the_supported_list():
    with pytest.raises(UnsupportedTensorType, match=r"`IQ2_XXS`.*Supported: F32, F16, BF16, Q4_0"):
        dequantize(torch.zeros(66, dtype=torch.uint8), "IQ2_XXS")


def test_partial_block_is_refused():
    with pytest.raises(ValueError, match="no whole number of `Q8_0` blocks"):
        dequantize(torch.zeros(35, dtype=torch.uint8), "Q8_0")
