"""fp8 checkpoints for tests, written the way real ones are: by compressed-tensors itself, and by the
block-wise format's definition.

`compressed_tensors_checkpoint(out, preset)` loads the embedded model (a trained Llama of 4
layers, hidden 256, intermediate 688, tied embeddings) in fp32 with transformers, applies the
library's own preset (`FP8_DYNAMIC`: per-channel weights, dynamic per-token activations; `FP8`:
per-tensor weights, static per-tensor activations; `FP8_BLOCK`: 128 x 128 blocks), fills the
scales from the weights with the library's `calculate_qparams` (min/max, as llm-compressor's
default observer) and, for static activations, from the largest input each layer sees over the
embedded model's held-out text (as its `static_minmax` observer), then `ModelCompressor` compresses
and `save_pretrained` + `update_config` write it: `weight` float8_e4m3fn, `weight_scale`,
`input_scale`, and `quantization_config` in config.json. `block_fp8_checkpoint(out)` writes the
`quant_method: fp8` format by its definition: per 128 x 128 block (the edge blocks narrower),
scale = amax / 448 as `weight_scale_inv`, the bytes the fp32 -> e4m3fn cast of w / scale. Both
copy the embedded model's tokenizer, and keep `lm_head` (tied) in the model dtype.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from workers.contract import DEFAULT_MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def _copy_tokenizer(out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (DEFAULT_MODEL_DIR / name).is_file():
            shutil.copy(DEFAULT_MODEL_DIR / name, out / name)


def embedded_fp32():
    """The embedded model in fp32 as transformers loads it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()


def calibration_ids(tokens: int = 256) -> torch.Tensor:
    """A few sequences of the embedded model's held-out text, tokenized: [4, tokens // 4]."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    ids = tok.encode((DEFAULT_MODEL_DIR / "heldout_sample.txt").read_text()).ids[:tokens]
    return torch.tensor(ids).reshape(4, -1)


@torch.no_grad()
def _input_amax(model) -> dict[str, float]:
    """The largest |input| each nn.Linear sees over the calibration text."""
    seen: dict[str, float] = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: seen.__setitem__(n, max(seen.get(n, 0.0),
                                                                                   float(a[0].abs().max()))))
             for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]  # fmt: skip
    model(calibration_ids())
    for h in hooks:
        h.remove()
    return seen


@torch.no_grad()
def compressed_tensors_checkpoint(out: Path, preset: str = "FP8_DYNAMIC",
                                  ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """The embedded model quantized by compressed-tensors with `preset`, saved to `out`."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = embedded_fp32()
    amax = _input_amax(model)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore),
                                quantization_status="initialized")
    apply_quantization_config(model, config, show_progress=False)
    for name, m in model.named_modules():
        qs = getattr(m, "quantization_scheme", None)
        if qs is None:
            continue
        w, args = m.weight.data, qs.weights
        if args.strategy == "channel":
            lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        elif args.strategy == "tensor":
            lo, hi = w.amin(), w.amax()
        else:  # block: the edge blocks are narrower
            bn, bk = args.block_structure
            rows, cols = -(-w.shape[0] // bn), -(-w.shape[1] // bk)
            pad = torch.nn.functional.pad(w, (0, cols * bk - w.shape[1], 0, rows * bn - w.shape[0]))
            blocks = pad.reshape(rows, bn, cols, bk)
            lo, hi = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
        scale, _ = calculate_qparams(lo, hi, args)
        m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
        if hasattr(m, "input_scale"):
            m.input_scale.data.fill_(amax[name] / 448.0)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    _copy_tokenizer(Path(out))
    return Path(out)


def block_quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3fn bytes [N, K], scales [ceil(N/128), ceil(K/128)]): the block-wise format's definition."""
    n, k = w.shape
    rows, cols = -(-n // block), -(-k // block)
    pad = torch.nn.functional.pad(w.to(torch.float32), (0, cols * block - k, 0, rows * block - n))
    scale = pad.reshape(rows, block, cols, block).abs().amax(dim=(1, 3)) / 448.0  # [rows, cols]
    scale = scale.clamp(min=torch.finfo(torch.float32).tiny)
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return (w.to(torch.float32) / full).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def block_dequantize(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The definition's inverse: each byte's value times its block's `weight_scale_inv`, in fp32."""
    n, k = q.shape
    return q.to(torch.float32) * scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]


@torch.no_grad()
def block_fp8_checkpoint(out: Path, not_convert: tuple[str, ...] = ("lm_head",)) -> Path:
    """The embedded model in the `quant_method: fp8` block-wise format, saved to `out`."""
    from safetensors.torch import save_file

    model = embedded_fp32()
    out = Path(out)
    model.save_pretrained(out)  # config.json and the fp32 tensors, replaced below
    tensors = {}
    linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, t in model.state_dict().items():
        module = name.removesuffix(".weight")
        if name in linear and not any(module == p or module.endswith("." + p) for p in not_convert):
            tensors[name], tensors[module + ".weight_scale_inv"] = block_quantize(t)
        elif name != "lm_head.weight":  # tied to the embedding
            tensors[name] = t.contiguous()
    for f in out.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128], "modules_to_not_convert": list(not_convert)}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _copy_tokenizer(out)
    return out


def dequantized_reference(ckpt: Path):
    """transformers' own reading of a compressed-tensors checkpoint, dequantized to fp32 (the parity reference)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()


# -- any checkpoint's projections and experts, quantized tensor by tensor ---------------------------

_QUANTIZED = ("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")  # attention, MLPs, experts (Mixtral w1/w2/w3)
CT_MOE_IGNORE = ("lm_head", "re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$")


def _ct_scheme(preset: str):
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme(preset, ["Linear"])


def _ct_quantize(w: torch.Tensor, scheme) -> dict[str, torch.Tensor]:
    """One weight through compressed-tensors: its observer's min/max scales, then its compressor."""
    from compressed_tensors.compressors import FloatQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    args = scheme.weights
    if args.strategy == "channel":
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    scale, _ = calculate_qparams(lo, hi, args)
    return FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)


@torch.no_grad()
def quantize_checkpoint(src: Path, out: Path, fmt: str = "block", preset: str = "FP8_DYNAMIC") -> Path:
    """`src` (a transformers checkpoint) with every projection and expert in fp8, written to `out`:
    `fmt="block"` by the block-wise format's definition, `fmt="compressed-tensors"` through the
    library's own compressor for `preset` (per tensor: transformers 5 holds experts stacked, so the
    library's model-level pass never sees them; its compressor runs on each stored tensor as it
    would on each `Linear`). Routers and `lm_head` stay in the model dtype."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    shutil.copytree(src, out)
    scheme = _ct_scheme(preset) if fmt == "compressed-tensors" else None
    tensors = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            t = f.get_tensor(name)
            module = name.removesuffix(".weight")
            if not name.endswith(_QUANTIZED) or t.dim() != 2:
                tensors[name] = t
            elif scheme is None:
                tensors[name], tensors[module + ".weight_scale_inv"] = block_quantize(t)
            else:
                tensors |= {f"{module}.{k}": v for k, v in _ct_quantize(t.to(torch.float32), scheme).items()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    if scheme is None:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128],
                                         "modules_to_not_convert": ["lm_head", "mlp.gate", "block_sparse_moe.gate"]}
    else:
        from compressed_tensors.quantization import QuantizationConfig

        qc = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(CT_MOE_IGNORE),
                                quantization_status="compressed", format="float-quantized").model_dump(mode="json")
        qc["config_groups"]["group_0"]["format"] = "float-quantized"
        config["quantization_config"] = {**qc, "quant_method": "compressed-tensors"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


@torch.no_grad()
def reference_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """Module name -> its weight in fp32 as the format's reference dequantizes it: compressed-tensors'
    own decompressor for its format, `q * weight_scale_inv` per block for the block-wise one."""
    from safetensors import safe_open

    with safe_open(str(Path(ckpt) / "model.safetensors"), framework="pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    qc = json.loads((Path(ckpt) / "config.json").read_text())["quantization_config"]
    out = {}
    if qc["quant_method"] == "fp8":
        for name, t in stored.items():
            if name.endswith(".weight_scale_inv"):
                module = name.removesuffix(".weight_scale_inv")
                out[module] = block_dequantize(stored[module + ".weight"], t)
        return out
    from compressed_tensors.compressors import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme.model_validate(qc["config_groups"]["group_0"])
    for name in stored:
        if name.endswith(".weight_scale"):
            module = name.removesuffix(".weight_scale")
            local = {k.removeprefix(module + "."): v for k, v in stored.items() if k.startswith(module + ".")}
            out[module] = FloatQuantizationCompressor.decompress(local, scheme)["weight"].to(torch.float32)
    return out


def dequantized_checkpoint(ckpt: Path, out: Path) -> Path:
    """`ckpt` with every quantized weight replaced by its reference dequantization (fp32), no
    `quantization_config`: what transformers runs as the dequantized model."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    ckpt, out = Path(ckpt), Path(out)
    shutil.copytree(ckpt, out)
    ref = reference_weights(ckpt)
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.endswith(("_scale", "_scale_inv"))}  # noqa: SIM118
    tensors |= {f"{m}.weight": w for m, w in ref.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
