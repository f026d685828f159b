"""MXFP4 checkpoints for tests: a transformers-written gpt-oss with its experts packed from the format's definition.

The packer quantizes each experts projection as the OCP microscaling spec describes it, with plain
arithmetic and shifts, independently of workers/quant/mxfp4.py: per block of 32 consecutive inputs
of one output, the shared exponent is floor(log2(max |w|)) - 2 (e2m1's largest value is 6 = 1.5 x
2^2), stored as e8m0 (+127); each value divided by 2^exponent is rounded to the nearest e2m1 value
(0, 0.5, 1, 1.5, 2, 3, 4, 6, signed: sign bit 3), and two codes share a byte, the even input in
the low nibble. gpt-oss stores `gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H] unquantized, so
the packed projection is the transpose: `P_blocks` [E, N, K/32, 16], `P_scales` [E, N, K/32].
`mxfp4_checkpoint` writes that checkpoint with gpt-oss's own `quantization_config`;
`dequantized_twin` writes the same model with the experts as transformers' `convert_moe_packed_tensors`
dequantizes them (fp32), and no `quantization_config`: what transformers runs for parity.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 codes 0..7; code | 8 is the negative
GPT_OSS_NOT_CONVERTED = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]
PROJECTIONS = ("gate_up_proj", "down_proj")


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] float weights -> (blocks uint8 [E, N, K/32, 16], scales uint8 [E, N, K/32])."""
    e, n, k = w.shape
    blocks = w.float().reshape(e, n, k // 32, 32)
    amax = blocks.abs().amax(-1)
    exp = torch.where(
        amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0**-126))) - 2, torch.full_like(amax, -127)
    )
    exp = exp.clamp(-127, 127)
    scaled = blocks / torch.pow(2.0, exp)[..., None]
    mags = torch.tensor(MAGNITUDES)
    code = (scaled.abs()[..., None] - mags).abs().argmin(-1)  # nearest magnitude (0..7)
    code = code | ((scaled < 0).to(torch.int64) << 3)
    byte = code[..., 0::2] | (code[..., 1::2] << 4)
    return byte.to(torch.uint8), (exp + 127).to(torch.uint8)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


@torch.no_grad()
def mxfp4_checkpoint(src: Path, out: Path, not_convert: tuple[str, ...] = ()) -> Path:
    """`src` (a gpt-oss checkpoint) with every experts projection in MXFP4 but those of `not_convert`
    (module names, `model.layers.1.mlp.experts`), listed in `modules_to_not_convert` too."""
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    shutil.copytree(src, out)
    tensors = {}
    for name, t in _tensors(src / "model.safetensors").items():
        module, _, leaf = name.rpartition(".")
        if leaf not in PROJECTIONS or not module.endswith("mlp.experts") or module in not_convert:
            tensors[name] = t
            continue
        blocks, scales = pack_mxfp4(t.transpose(1, 2))  # [E, K, N] as gpt-oss stores it -> [E, N, K]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [*GPT_OSS_NOT_CONVERTED, *not_convert],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def dequantized_twin(ckpt: Path, out: Path) -> Path:
    """The MXFP4 checkpoint `ckpt` with its experts dequantized by transformers (fp32), unquantized."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ckpt, out = Path(ckpt), Path(out)
    shutil.copytree(ckpt, out)
    stored = _tensors(ckpt / "model.safetensors")
    tensors = {}
    for name, t in stored.items():
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            tensors[base] = convert_moe_packed_tensors(t, stored[base + "_scales"], dtype=torch.float32)
        else:
            tensors[name] = t
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
