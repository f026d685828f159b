"""What a model needs of a device, read from its files without loading a weight (no torch).

Design: placement (server/fleet/placement.py) must know, before any worker starts, how many bytes
each model takes on each device. `read_profile(dir)` reads the safetensors headers (every tensor's
dtype and shape: exact, whatever the family), or for a config alone counts from its shapes.
`need_on(profile, device, dtype, quantize)` is the need on one device: the weights as that device
loads them (floating tensors in the dtype `dtype_rule` picks; `--quantize fp8` projections at a
byte per weight plus a scale per row; pre-quantized tensors at their stored bytes where the
device runs them as stored and widened where its fp8, 4-bit or MXFP4 rule dequantizes them) plus
the KV cache of one sequence of `KV_TOKENS` tokens; a device offers `USABLE_FRACTION` of its
memory. Trade-offs: the KV figure is a floor (one sequence, every layer full attention), so a
placed model gets more KV from what is left; a simulated device is sized as a real GPU of its
capability loads the model, though it computes on the CPU."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from workers.contract.device import DeviceInfo
from workers.contract.dtypes import DTYPE_BYTES, SAFETENSORS_BYTES, SAFETENSORS_FLOATS, dtype_rule
from workers.contract.fp8_rule import FP8_DEQUANTIZED, fp8_execution
from workers.contract.gguf_rule import GGUF_PACKED, gguf_kind
from workers.contract.int4_rule import INT4_DEQUANTIZED, int4_kind
from workers.contract.mxfp4_rule import MXFP4_DEQUANTIZED, mxfp4_kind
from workers.contract.sizes import human

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
KV_TOKENS = 4096  # the context of the one sequence a placed model must hold in KV cache at least
USABLE_FRACTION = 0.9  # of a device's memory, for weights and KV cache
FP8_SCALE_BYTES = 4  # one fp32 scale per output row of an fp8 projection
MAX_HEADER_BYTES = 100 << 20  # a safetensors header beyond this is no header
_PACKED4 = re.compile(r"(qweight|weight_packed)$")  # GPTQ/AWQ and compressed-tensors 4-bit weights
_MXFP4 = re.compile(r"experts\.\w+_proj_(blocks|scales)$")  # gpt-oss's MXFP4 experts: e2m1 blocks, e8m0 scales
_PROJECTION = re.compile(r"_proj\.weight$")  # q/k/v/o and gate/up/down: the nn.Linear layers fp8 replaces


class ModelSizeError(ValueError):
    """A model directory whose size cannot be read; the message names the file and the problem."""


@dataclass(frozen=True)
class ModelProfile:
    """A model's sizes as its files state them, independent of any device."""

    path: str
    architecture: str | None  # config.json's model_type (the worker reports its family once loaded)
    context_length: int
    checkpoint_dtype: str | None  # what config.json says the weights were saved in
    quantization: str | None  # config.json's quantization_config.quant_method, if pre-quantized
    float_params: int  # floating tensors: loaded in the compute dtype
    projection_params: int  # of those, the projection weights `--quantize fp8` stores in one byte
    projection_rows: int  # their output rows (one fp8 scale each)
    stored_params: int  # tensors stored quantized (fp8, packed integers): kept as they are
    stored_bytes: int
    kv_elements_per_token: int  # 2 (K and V) x layers x KV heads x head dim
    source: str  # where the figures come from
    fp8_params: int = 0  # of the stored tensors, fp8 weights (one byte each as stored)
    packed4_params: int = 0  # 4-bit values packed eight per int32 (`qweight`, `weight_packed`)
    packed4_expert_params: int = 0  # of those, the experts' (widened at load on every device)
    mxfp4_params: int = 0  # MXFP4 experts' e2m1 values, two per byte of `*_blocks`
    mxfp4_bytes: int = 0  # their blocks and e8m0 `*_scales` as stored
    gguf_params: int = 0  # a GGUF file's projections of a type the kernels decode (workers/contract/gguf_rule.py)
    gguf_bytes: int = 0  # their blocks as stored: held so where the device keeps them packed
    gguf_cpu_params: int = 0  # of those, the ones of a type the CPU keeps packed (`CPU_PACKED_TYPES`)
    gguf_cpu_bytes: int = 0
    gguf_cpu_tied_params: int = 0  # a tied head's embedding, counted as floating, that the CPU keeps as blocks
    gguf_cpu_tied_bytes: int = 0

    @property
    def num_parameters(self) -> int:
        """Weights as stored: the floating ones, the stored-quantized tensors' elements and a GGUF file's
        packable blocks' values (counted apart from the floating ones)."""
        return self.float_params + self.stored_params + self.gguf_params


@dataclass(frozen=True)
class Need:
    """What one model takes on one device, with the figures behind it."""

    dtype: str
    dtype_reason: str
    quantize: str
    weight_bytes: int
    kv_bytes: int
    kv_tokens: int
    packed4: str = ""  # how this device holds a 4-bit checkpoint's layers: "packed" | "widened" ("": none)
    gguf: str = ""  # how this device holds a GGUF file's projections: "packed" | "dequantized" ("": none)

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def describe(self) -> str:
        """`weights 7.5 GiB (bfloat16) + KV 512 MiB (4096 tokens) = 8 GiB`."""
        how = self.dtype + (", fp8 projections" if self.quantize == "fp8" else "")
        how += {"packed": ", 4-bit layers packed", "widened": ", 4-bit layers widened at load"}.get(self.packed4, "")
        how += {"packed": ", GGUF blocks packed", "dequantized": ", GGUF blocks dequantized at load"}.get(self.gguf, "")
        return (f"weights {human(self.weight_bytes)} ({how}) + KV {human(self.kv_bytes)} ({self.kv_tokens} tokens) "
                f"= {human(self.total)}")

    def to_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total}


def usable_bytes(device: DeviceInfo, fraction: float | None = None) -> int:
    """What a device offers a model: `fraction` of its memory (`--gpu-memory-utilization`),
    else `USABLE_FRACTION`."""
    return int(device.memory_total_bytes * (USABLE_FRACTION if fraction is None else fraction))


def need_on(profile: ModelProfile, device: DeviceInfo, dtype: str = "auto", quantize: str = "none") -> Need:
    """The bytes `profile` takes on `device`: weights as loaded there, plus the KV floor. A
    simulated device is sized as a real GPU of its capability loads the model, though its worker
    computes on the CPU (where a float16 checkpoint loads as float32)."""
    compute = "cpu" if device.type == "cpu" else "cuda"
    cap = None if device.capability is None else tuple(device.capability)
    name, reason = dtype_rule(dtype, profile.checkpoint_dtype, compute, cap)
    size = DTYPE_BYTES[name]
    floats = profile.float_params
    weights = profile.stored_bytes
    if profile.fp8_params and fp8_execution(device.type, cap).kind == FP8_DEQUANTIZED:
        weights += profile.fp8_params * (size - 1)  # widened once at load on this device
    # 4-bit layers widen at load where the device has no 4-bit execution, experts everywhere
    # (workers/quant/int4_reader.py); elsewhere they stay packed, as stored
    widens = int4_kind(device.type, cap) == INT4_DEQUANTIZED
    widened4 = profile.packed4_params if widens else profile.packed4_expert_params
    weights += widened4 * size - widened4 // 2
    packed4 = "" if not profile.packed4_params else "widened" if widens else "packed"
    if profile.mxfp4_params and mxfp4_kind(device.type, cap) == MXFP4_DEQUANTIZED:  # widened at load there
        weights += profile.mxfp4_params * size - profile.mxfp4_bytes  # (workers/quant/mxfp4_reader.py)
    gguf = ""
    if profile.gguf_params:  # a GGUF file's projections: its blocks where the device keeps them packed
        gguf = gguf_kind(device.type, cap)
        if gguf != GGUF_PACKED:
            weights += profile.gguf_params * size
        elif device.type == "cpu":  # the CPU kernel's types packed, the rest widened at load
            weights += profile.gguf_cpu_bytes + (profile.gguf_params - profile.gguf_cpu_params) * size
            weights += profile.gguf_cpu_tied_bytes - profile.gguf_cpu_tied_params * size  # not widened there
        else:
            weights += profile.gguf_bytes
    if quantize == "fp8":
        weights += profile.projection_params + profile.projection_rows * FP8_SCALE_BYTES
        floats -= profile.projection_params
    weights += floats * size
    tokens = min(KV_TOKENS, profile.context_length)
    return Need(name, reason, quantize, weights, profile.kv_elements_per_token * size * tokens, tokens, packed4, gguf)


# --- reading a model directory ------------------------------------------------------------
def read_config(model_dir: Path) -> dict:
    path = Path(model_dir) / CONFIG_FILE
    try:
        hf = json.loads(path.read_text())
    except OSError as e:
        raise ModelSizeError(f"`{path}` cannot be read ({e.strerror}): a model directory holds a config.json") from e
    except ValueError as e:
        raise ModelSizeError(f"`{path}` is not valid JSON: {e}") from e
    if not isinstance(hf, dict):
        raise ModelSizeError(f"`{path}` is not a JSON object")
    text = hf.get("text_config")
    return {**hf, **text} if isinstance(text, dict) else hf


def _int(hf: dict, *names: str, default: int | None = None) -> int:
    for name in names:
        value = hf.get(name)
        if isinstance(value, int) and value >= 0:
            return value
    if default is not None:
        return default
    raise ModelSizeError(f"config.json lacks `{names[0]}` (a non-negative integer)")


def _shape(hf: dict) -> dict:
    """The dimensions both counts need, with the fallbacks transformers' configs use."""
    hidden = _int(hf, "hidden_size", "n_embd", "d_model")
    heads = _int(hf, "num_attention_heads", "n_head")
    return {
        "h": hidden, "heads": heads, "layers": _int(hf, "num_hidden_layers", "n_layer"),
        "kv_heads": _int(hf, "num_key_value_heads", default=heads),
        "head_dim": hf.get("head_dim") if isinstance(hf.get("head_dim"), int) else hidden // max(1, heads),
        "vocab": _int(hf, "vocab_size"), "inter": _int(hf, "intermediate_size", "n_inner", default=4 * hidden),
        "experts": _int(hf, "num_local_experts", "num_experts", "n_routed_experts", default=0),
        "moe_inter": _int(hf, "moe_intermediate_size", default=0),
    }


def _context_length(hf: dict) -> int:
    base = _int(hf, "max_position_embeddings", "n_positions", "max_sequence_length", default=2048)
    scaling = hf.get("rope_scaling") or {}
    if isinstance(scaling, dict) and (scaling.get("rope_type") or scaling.get("type")) == "dynamic":
        return int(base * float(scaling.get("factor", 1.0)))
    return base


def _quantization(hf: dict) -> str | None:
    q = hf.get("quantization_config")
    return (q.get("quant_method") or q.get("format") or "quantized") if isinstance(q, dict) else None


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (OSError, ValueError, AttributeError) as e:
            raise ModelSizeError(f"`{index}` is not a safetensors index: {e}") from e
        return [model_dir / f for f in dict.fromkeys(weight_map.values())]
    return sorted(model_dir.glob("*.safetensors"))


def read_header(path: Path) -> dict:
    """A safetensors file's header: tensor name -> {dtype, shape, data_offsets} (no weights read)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if not 0 < n <= MAX_HEADER_BYTES:
                raise ModelSizeError(f"`{path}` is not a safetensors file (header of {n} bytes)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ModelSizeError(f"`{path}` cannot be read: {e.strerror}") from e
    except (struct.error, ValueError) as e:
        raise ModelSizeError(f"`{path}` is not a safetensors file: {e}") from e
    header.pop("__metadata__", None)
    return header


def read_profile(model_dir: str | Path) -> ModelProfile:
    """`model_dir`'s sizes: from its safetensors headers, else counted from config.json."""
    model_dir = Path(model_dir)
    hf = read_config(model_dir)
    try:
        shape = _shape(hf)
    except ModelSizeError as e:
        raise ModelSizeError(f"`{model_dir / CONFIG_FILE}`: {e}") from e
    quantization = _quantization(hf)
    common = {
        "path": str(model_dir), "architecture": hf.get("model_type"), "context_length": _context_length(hf),
        "checkpoint_dtype": hf.get("torch_dtype") or hf.get("dtype"), "quantization": quantization,
        "kv_elements_per_token": 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"],
    }
    gguf = _gguf_sizes(model_dir)
    if gguf is not None:  # a prepared GGUF directory (workers/gguf/prepare.py): its tensor table's figures
        packable = gguf["packable_elements"]
        return ModelProfile(**common, float_params=gguf["elements"] - packable, projection_params=0,
                            projection_rows=0, stored_params=0, stored_bytes=0, gguf_params=packable,
                            gguf_bytes=gguf["packable_bytes"], gguf_cpu_params=gguf.get("cpu_packable_elements", 0),
                            gguf_cpu_bytes=gguf.get("cpu_packable_bytes", 0),
                            gguf_cpu_tied_params=gguf.get("cpu_tied_elements", 0),
                            gguf_cpu_tied_bytes=gguf.get("cpu_tied_bytes", 0), source="GGUF tensor table")
    files = _weight_files(model_dir)
    if not files:
        return ModelProfile(**common, **_count_from_config(hf, shape),
                            source="config.json (no weights in the directory: counted from its shapes)")
    floats = projections = rows = stored = stored_bytes = tensors = fp8 = packed4 = mxfp4 = mxfp4_bytes = 0
    packed4_experts = 0
    for path in files:
        for name, t in read_header(path).items():
            kind, dims = t.get("dtype"), t.get("shape", [])
            if kind not in SAFETENSORS_BYTES:
                raise ModelSizeError(f"`{path}`: tensor `{name}` has dtype `{kind}`. "
                                     f"Known: {', '.join(SAFETENSORS_BYTES)}")
            n = 1
            for d in dims:
                n *= d
            tensors += 1
            if kind in SAFETENSORS_FLOATS and not (quantization and "scale" in name):
                floats += n
                if len(dims) == 2 and _PROJECTION.search(name) and "experts" not in name:
                    projections, rows = projections + n, rows + dims[0]
            else:
                stored, stored_bytes = stored + n, stored_bytes + int(n * SAFETENSORS_BYTES[kind])
                if kind.startswith("F8"):
                    fp8 += n
                elif kind == "I32" and _PACKED4.search(name):
                    packed4 += 8 * n
                    packed4_experts += 8 * n if "experts" in name else 0
                elif kind == "U8" and quantization == "mxfp4" and _MXFP4.search(name):
                    mxfp4, mxfp4_bytes = mxfp4 + (2 * n if name.endswith("_blocks") else 0), mxfp4_bytes + n
    return ModelProfile(**common, float_params=floats, projection_params=projections, projection_rows=rows,
                        stored_params=stored, stored_bytes=stored_bytes, fp8_params=fp8, packed4_params=packed4,
                        packed4_expert_params=packed4_experts,
                        mxfp4_params=mxfp4, mxfp4_bytes=mxfp4_bytes,
                        source=f"safetensors headers ({tensors} tensors in {len(files)} file(s))")


def _gguf_sizes(model_dir: Path) -> dict | None:
    """The sizes a prepared GGUF directory's `gguf.json` records; None for any other directory."""
    try:
        sizes = json.loads((model_dir / "gguf.json").read_text()).get("sizes")
    except (OSError, ValueError):
        return None
    return sizes if isinstance(sizes, dict) else None


def _count_from_config(hf: dict, s: dict) -> dict:
    """Parameters of a decoder of these shapes (biases left out: a fraction of a percent)."""
    h, d, layers = s["h"], s["head_dim"], s["layers"]
    q, kv = s["heads"] * d, s["kv_heads"] * d
    attention = h * q + 2 * h * kv + q * h
    dense = 3 * h * s["inter"]
    experts = s["experts"] * 3 * h * (s["moe_inter"] or s["inter"]) + s["experts"] * h if s["experts"] else 0
    tied = hf.get("tie_word_embeddings", True) is not False
    embeddings = s["vocab"] * h * (1 if tied else 2)
    per_layer = attention + (experts or dense) + 2 * h
    rows = q + 2 * kv + h + (0 if experts else 2 * s["inter"] + h)
    return {"float_params": embeddings + layers * per_layer + h,
            "projection_params": layers * (attention + (0 if experts else dense)), "projection_rows": layers * rows,
            "stored_params": 0, "stored_bytes": 0}
