"""compressed-tensors' `pack-quantized` format: llm-compressor's W4A16 (with and without zero points).

Design: `read(qc)` turns a `quant_method: compressed-tensors` config whose groups are
`pack-quantized` into an `Int4Config`: each group's targets and its 4-bit integer weights by
`group` or `channel`, symmetric or not, with `ignore` as compressed-tensors matches it. The weight
is `(q - z) * s` in the scale's dtype, as the library's decompressor computes it; the stored
tensors and the refusals: docs/quantization-int4.md. Trade-off: the whole config is checked at
load, as for fp8, so a checkpoint never serves partly approximated."""

from __future__ import annotations

from workers.quant.int4_scheme import Int4Config, Int4Scheme, check_bits, check_group
from workers.quant.scheme import unsupported

NAME = "compressed-tensors"
FORMAT = "pack-quantized"
STRATEGIES = ("group", "channel")
ACTORDERS = (None, "weight")  # "weight": columns reordered during calibration, nothing stored


def is_int4(qc: dict) -> bool:
    """Whether a compressed-tensors config is the pack-quantized integer format this module reads."""
    for group in (qc.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if (group.get("format") or qc.get("format")) == FORMAT and weights.get("type", "int") == "int":
            return True
    return False


def _scheme(name: str, group: dict) -> Int4Scheme:
    args = group.get("weights") or {}
    if args.get("type") != "int":
        raise unsupported(f"weight type of config group `{name}`", args.get("type"), ["int"])
    check_bits(args.get("num_bits"), f"pack-quantized config group `{name}`")
    strategy = args.get("strategy")
    if strategy not in STRATEGIES:
        raise unsupported(f"weight strategy of config group `{name}`", strategy, STRATEGIES)
    size = -1 if strategy == "channel" else check_group(args.get("group_size"), f"config group `{name}`",
                                                        (32, 64, 128))
    if args.get("dynamic"):
        raise unsupported(f"weight quantization of config group `{name}`", "dynamic", ["static"])
    if args.get("actorder") not in ACTORDERS:
        raise unsupported(f"`actorder` of config group `{name}`", args.get("actorder"), ["null", "weight"])
    for key in ("input_activations", "output_activations"):
        if group.get(key):
            raise unsupported(f"`{key}` of config group `{name}`", group[key], ["null (W4A16)"])
    sym = args.get("symmetric", True) is not False
    return Int4Scheme("pack-quantized", size, sym, zero_points=not sym)


def read(qc: dict) -> Int4Config:
    """The `Int4Config` of a pack-quantized compressed-tensors config; `UnsupportedQuantizationError` otherwise."""
    # 1. what the checkpoint must not carry
    if qc.get("kv_cache_scheme"):
        raise unsupported("compressed-tensors `kv_cache_scheme`", qc["kv_cache_scheme"], ["null"])
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise unsupported(f"compressed-tensors `{key}`", qc[key], ["empty"])
    # 2. every config group pack-quantized, with its targets and scheme
    groups = []
    for name, group in (qc.get("config_groups") or {}).items():
        fmt = group.get("format") or qc.get("format")
        if fmt != FORMAT:
            raise unsupported(f"compressed-tensors format of config group `{name}` beside pack-quantized ones",
                              fmt, [FORMAT])
        targets = tuple(group.get("targets") or ())
        if not targets:
            raise unsupported(f"targets of config group `{name}`", targets, ["`Linear`, module names, `re:` patterns"])
        groups.append((targets, _scheme(name, group)))
    return Int4Config(NAME, FORMAT, tuple(groups), tuple(qc.get("ignore") or ()), ignore_rule="compressed-tensors")
