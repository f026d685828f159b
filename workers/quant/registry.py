"""The quantization-method registry: which module reads a checkpoint's `quantization_config`, and
which reader then loads its tensors.

Design: one module per method, each with its `NAME` (the config's `quant_method`) and `read(qc)`;
`read_quantization(hf_config)` looks the method up, so adding a method is a module and a line.
No `quantization_config` is served unquantized; an unknown method is refused naming the registered
ones (at load, and by `hetserve plan --model`). The 4-bit formats are asked first through one hook
(`int4_methods.handles`), since compressed-tensors names its fp8 and 4-bit formats alike; the
names are also the contract's `QUANT_METHODS`, which the router checks before any worker starts
(a test holds the two equal). `quantized_checkpoint` gives the loader the reader of the config's
kind for the device it names. Trade-off: the registry knows only the methods whose layers exist;
a method name alone never makes a checkpoint load."""

from __future__ import annotations

from workers.contract.checkpoint_check import QUANT_METHODS
from workers.quant import compressed_tensors, fp8_blockwise, int4_methods, mxfp4
from workers.quant.checkpoint import ModelMap
from workers.quant.fp8_reader import QuantizedCheckpoint
from workers.quant.int4_reader import Int4Checkpoint
from workers.quant.int4_scheme import Int4Config
from workers.quant.mxfp4 import Mxfp4Config
from workers.quant.mxfp4_reader import Mxfp4Checkpoint
from workers.quant.scheme import QuantConfig, unsupported

METHODS = {m.NAME: m.read for m in (compressed_tensors, fp8_blockwise, mxfp4)}
CheckpointReader = QuantizedCheckpoint | Int4Checkpoint | Mxfp4Checkpoint  # driven by the loader (checkpoint.py)


def read_quantization(hf_config: dict) -> QuantConfig | Int4Config | Mxfp4Config | None:
    """The checkpoint's `QuantConfig` (fp8), `Int4Config` (4-bit) or `Mxfp4Config` (gpt-oss's MXFP4 experts),
    or None without `quantization_config`."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    if int4_methods.handles(qc):  # GPTQ, AWQ, compressed-tensors pack-quantized (workers/quant/int4_methods.py)
        return int4_methods.read(qc)
    method = qc.get("quant_method")
    if method not in METHODS:
        raise unsupported("quantization method", method, QUANT_METHODS)
    return METHODS[method](qc)


def describe_quantization(hf_config: dict) -> dict | None:
    """What `hetserve plan --model` and `/workers` show of the checkpoint's quantization (no weights read)."""
    quant = read_quantization(hf_config)
    return None if quant is None else quant.describe()


def quantized_checkpoint(hf_config: dict, model_map: ModelMap, device_type: str,
                         capability: tuple[int, int] | None) -> CheckpointReader | None:
    """The reader of a quantized checkpoint, laying its layers out for the device `device_type` at
    `capability` (the one the worker serves); None for an unquantized checkpoint."""
    quant = read_quantization(hf_config)
    if isinstance(quant, Int4Config):  # 4-bit: packed or dequantized at load, per device (int4_reader.py)
        return Int4Checkpoint(quant, model_map, device_type, capability)
    if isinstance(quant, Mxfp4Config):  # gpt-oss's MXFP4 experts: packed or dequantized at load (mxfp4_reader.py)
        return Mxfp4Checkpoint(quant, model_map, device_type, capability)
    return None if quant is None else QuantizedCheckpoint(quant, model_map)
