"""4-bit checkpoints for tests, packed from each format's definition (and compressed-tensors' own packer).

Each packer takes a float weight [out, in], quantizes it the way the format's tools do (min/max
per group: symmetric with zero point 8, or asymmetric; GPTQ's act-order as a random assignment of
inputs to groups), and writes the tensors the format stores, packed here with plain shifts and ORs,
independently of the code under test:
- GPTQ: `qweight` [in/8, out] (input 8i+j in bits 4j), `qzeros` [groups, out/8] (stored minus 1 in
  the v1 `gptq` format), `scales` [groups, out], `g_idx` [in];
- AWQ: `qweight` [in, out/8] and `qzeros` [groups, out/8] with word nibble i holding column
  8c + [0, 2, 4, 6, 1, 3, 5, 7][i], `scales` [groups, out];
- pack-quantized: `weight_packed` [out, in/8] of values + 8, `weight_scale` [out, groups],
  `weight_shape`, `weight_zero_point` [out/8, groups] of zero points + 8 (asymmetric only).
Each returns the reference weight too: `(q - z) * s` computed natively in the scale's dtype, as
AutoGPTQ's, AutoAWQ's and compressed-tensors' torch paths compute it. `quantize_checkpoint` turns a
transformers checkpoint into a 4-bit one and `dequantized_twin` writes its reference weights as an
unquantized checkpoint, what transformers runs for parity.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _words(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """Pack [..., 8 * W] values in [0, 15] into int32 words along the last dim: nibble i = value 8w + order[i]."""
    v = values.to(torch.int64)
    word = torch.zeros(*v.shape[:-1], v.shape[-1] // 8, dtype=torch.int64)
    for i, j in enumerate(order):
        word |= v[..., j::8] << (4 * i)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _quantize(w: torch.Tensor, groups: torch.Tensor, count: int, sym: bool, dtype: torch.dtype, rng):
    """q [out, in] in [0, 15], zero points [out, count] and scales [out, count] (`dtype`) by min/max per group."""
    out = w.shape[0]
    s = torch.empty(out, count)
    z = torch.empty(out, count, dtype=torch.int64)
    for g in range(count):
        cols = w[:, groups == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            s[:, g], z[:, g] = torch.maximum(-lo, hi) * 2 / 15, 8
        else:
            s[:, g] = (hi - lo) / 15
            z[:, g] = torch.round(-lo / s[:, g]).clamp(0, 15).to(torch.int64)
    s = s.clamp(min=1e-6).to(dtype)
    if not sym:  # exercise every zero point, 0 and 15 included
        z[: min(out, 16)] = torch.arange(16)[: min(out, 16), None] % 16
    q = torch.clamp(torch.round(w / s.to(torch.float32)[:, groups]) + z[:, groups], 0, 15).to(torch.int64)
    return q, z, s


def _reference(q, z, s, groups) -> torch.Tensor:
    """(q - z) * s natively in the scale dtype: [out, in]."""
    return (q - z[:, groups]).to(s.dtype) * s[:, groups]


def gptq_tensors(w, group: int, sym: bool = True, fmt: str = "gptq", desc_act: bool = False,
                 dtype=torch.float16, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:  # fmt: skip
    """GPTQ's tensors of `w` [out, in] and the reference weight."""
    rng = torch.Generator().manual_seed(seed)
    out, k = w.shape
    size = k if group == -1 else group
    count = -(-k // size)
    groups = torch.arange(k) // size
    if desc_act:  # act-order: each input's group, a shuffled assignment of the same group sizes
        groups = groups[torch.randperm(k, generator=rng)]
    q, z, s = _quantize(w.float(), groups, count, sym, dtype, rng)
    if fmt == "gptq":
        z = z.clamp(min=1)  # v1 stores z - 1 (a zero point of 0 has no v1 spelling)
    ref = _reference(q, z, s, groups)
    stored_z = z - 1 if fmt == "gptq" else z
    tensors = {"qweight": _words(q).t().contiguous(),
               "qzeros": _words(stored_z.t().contiguous()), "scales": s.t().contiguous(),
               "g_idx": groups.to(torch.int32)}
    return tensors, ref


def awq_tensors(w, group: int, dtype=torch.float16, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """AWQ's GEMM tensors of `w` [out, in] and the reference weight."""
    rng = torch.Generator().manual_seed(seed)
    k = w.shape[1]
    groups = torch.arange(k) // group
    q, z, s = _quantize(w.float(), groups, -(-k // group), False, dtype, rng)
    tensors = {"qweight": _words(q.t().contiguous(), AWQ_ORDER), "qzeros": _words(z.t().contiguous(), AWQ_ORDER),
               "scales": s.t().contiguous()}
    return tensors, _reference(q, z, s, groups)


def pack_quantized_tensors(w, group: int, sym: bool = True, dtype=torch.bfloat16,
                           seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:  # fmt: skip
    """compressed-tensors' pack-quantized tensors of `w` [out, in] (group -1: per channel) and the reference."""
    rng = torch.Generator().manual_seed(seed)
    out, k = w.shape
    size = k if group == -1 else group
    groups = torch.arange(k) // size
    q, z, s = _quantize(w.float(), groups, -(-k // size), sym, dtype, rng)
    ref = _reference(q, z, s, groups)
    pad = -k % 8
    tensors = {"weight_packed": _words(torch.nn.functional.pad(q, (0, pad))), "weight_scale": s,
               "weight_shape": torch.tensor([out, k])}
    if not sym:
        zp = torch.nn.functional.pad(z.t(), (0, -out % 8))  # [groups, out]: packed along the output dim
        tensors["weight_zero_point"] = _words(zp).t().contiguous()
    return tensors, ref


# -- whole checkpoints -------------------------------------------------------------------------------

_PROJ = ("_proj.weight",)


def _config_of(fmt: str, group: int, sym: bool, desc_act: bool, not_convert: tuple[str, ...]) -> dict:
    if fmt in ("gptq", "gptq_v2"):
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym, "desc_act": desc_act,
                "checkpoint_format": fmt, "modules_to_not_convert": list(not_convert) or None}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": list(not_convert) or None}
    strategy = {"strategy": "channel"} if group == -1 else {"strategy": "group", "group_size": group}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": sym,
                                                      "dynamic": False, "observer": "minmax", **strategy},
                                          "input_activations": None, "output_activations": None}},
            "ignore": ["lm_head", *(f"re:.*{p}$" for p in not_convert)]}


@torch.no_grad()
def _order_seed(module: str, seed: int) -> int:
    """The act-order seed of a module: shared by the projections that read the same input (q/k/v of
    one layer, gate/up of one layer), as GPTQ's order comes from that input's Hessian."""
    for parts, key in ((("q_proj", "k_proj", "v_proj"), "qkv"), (("gate_proj", "up_proj"), "gate_up")):
        for part in parts:
            if module.endswith(part):
                return sum(ord(c) for c in module.removesuffix(part) + key)
    return seed


def quantize_checkpoint(src: Path, out: Path, fmt: str, group: int = 32, sym: bool = True, desc_act: bool = False,
                        not_convert: tuple[str, ...] = (), zero_bias: bool = False,
                        shared_order: bool = False) -> tuple[Path, dict]:  # fmt: skip
    """`src` with every projection but `not_convert` (module name suffixes) in 4 bits; (dir, references).
    `zero_bias`: a zero `bias` beside each 4-bit layer that has none, as AutoGPTQ writes. `shared_order`:
    act-order's input order shared by the projections of one input (as GPTQ writes it), else each its own."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    shutil.copytree(src, out)
    tensors, refs = {}, {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    for seed, (name, t) in enumerate(stored.items()):
        module = name.removesuffix(".weight")
        if not name.endswith(_PROJ) or t.dim() != 2 or module.endswith(not_convert):
            tensors[name] = t
            continue
        if fmt in ("gptq", "gptq_v2"):
            order = _order_seed(module, seed) if shared_order else seed
            packed, ref = gptq_tensors(t, group, sym, fmt, desc_act, seed=order)
        elif fmt == "awq":
            packed, ref = awq_tensors(t, group, seed=seed)
        else:
            packed, ref = pack_quantized_tensors(t, group, sym, seed=seed)
        tensors |= {f"{module}.{k}": v for k, v in packed.items()}
        refs[module] = ref
        if zero_bias and f"{module}.bias" not in stored:
            tensors[f"{module}.bias"] = torch.zeros(t.shape[0], dtype=torch.float16)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = _config_of(fmt, group, sym, desc_act, not_convert)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out, refs


def dequantized_twin(src: Path, refs: dict[str, torch.Tensor], out: Path) -> Path:
    """`src` (unquantized) with each quantized module's weight replaced by its reference dequantization, fp32."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    shutil.copytree(src, out)
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    tensors |= {f"{m}.weight": w.to(torch.float32) for m, w in refs.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
