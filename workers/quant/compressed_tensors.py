"""compressed-tensors (llm-compressor's checkpoints): the `float-quantized` fp8 format.

Design: `read(qc)` turns a `quant_method: compressed-tensors` config into a `QuantConfig`: its
groups' targets (`Linear`, module names, `re:` patterns) with their weights' and input
activations' schemes, and the `ignore` list. A dynamic `tensor` activation strategy runs per
token (finer, and a row's result then depends on no batch mate). The formats, their tensors and
the refusals: docs/quantized-checkpoints.md. Trade-off: the whole config is checked at load, so
a checkpoint with one scheme we do not run fails to start instead of serving partly approximated."""

from __future__ import annotations

from workers.quant.scheme import Fp8Scheme, QuantConfig, unsupported

NAME = "compressed-tensors"
FORMATS = ("float-quantized", "naive-quantized")  # naive-quantized stores fp8 weights the same way
_STRATEGIES = {"tensor": "tensor", "channel": "channel", "block": "block"}


def _weights(args: dict | None, group: str) -> tuple[str, tuple[int, int] | None]:
    if not args:
        raise unsupported(f"config group `{group}` without `weights`", args, ["8-bit float weights"])
    kind = (args.get("type"), args.get("num_bits"))
    if kind != ("float", 8):
        raise unsupported(f"weight type of config group `{group}`", f"{kind[0]}{kind[1]}", ["float8 (e4m3)"])
    if args.get("symmetric") is False or args.get("dynamic"):
        raise unsupported(f"weight quantization of config group `{group}`",
                          "asymmetric" if args.get("symmetric") is False else "dynamic", ["static symmetric"])
    strategy = args.get("strategy")
    if strategy not in _STRATEGIES:
        raise unsupported(f"weight strategy of config group `{group}`", strategy, list(_STRATEGIES))
    block = args.get("block_structure")
    return strategy, (tuple(block) if block else None)


def _activations(args: dict | None, group: str) -> tuple[str, str | None]:
    if not args:
        raise unsupported(f"input activations of config group `{group}`", None,
                          ["fp8 per token (dynamic), per tensor (static `input_scale`), per group of 128 (dynamic)"])
    kind = (args.get("type"), args.get("num_bits"))
    if kind != ("float", 8):
        raise unsupported(f"activation type of config group `{group}`", f"{kind[0]}{kind[1]}", ["float8 (e4m3)"])
    strategy, dynamic = args.get("strategy"), bool(args.get("dynamic"))
    if args.get("symmetric") is False:
        raise unsupported(f"activation quantization of config group `{group}`", "asymmetric", ["symmetric"])
    if dynamic and strategy in ("token", "tensor"):
        note = None if strategy == "token" else f"config group `{group}`: dynamic per-tensor activations run per token"
        return "dynamic_token", note
    if dynamic and strategy == "group" and args.get("group_size") == 128:
        return "dynamic_group", None
    if not dynamic and strategy == "tensor":
        return "static_tensor", None
    raise unsupported(f"activation scheme of config group `{group}`",
                      f"{'dynamic' if dynamic else 'static'} {strategy} (group size {args.get('group_size')})",
                      ["dynamic token", "static tensor", "dynamic group of 128 (with block weights)"])


def read(qc: dict) -> QuantConfig:
    """The `QuantConfig` of a compressed-tensors `quantization_config`; `UnsupportedQuantizationError` otherwise."""
    # 1. what the checkpoint must not carry: a KV cache scheme, sparsity, transforms
    if qc.get("kv_cache_scheme"):
        raise unsupported("compressed-tensors `kv_cache_scheme`", qc["kv_cache_scheme"], ["null (KV cache in the "
                                                                                          "model dtype)"])
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise unsupported(f"compressed-tensors `{key}`", qc[key], ["empty"])
    # 2. each config group: its format, targets and scheme
    groups, notes = [], []
    for name, group in (qc.get("config_groups") or {}).items():
        fmt = group.get("format") or qc.get("format")
        if fmt not in FORMATS:
            raise unsupported(f"compressed-tensors format of config group `{name}`", fmt, FORMATS)
        if group.get("output_activations"):
            raise unsupported(f"output activation quantization of config group `{name}`",
                              group["output_activations"], ["null"])
        weights, block = _weights(group.get("weights"), name)
        activations, note = _activations(group.get("input_activations"), name)
        notes += [note] if note else []
        targets = tuple(group.get("targets") or ())
        if not targets:
            raise unsupported(f"targets of config group `{name}`", targets, ["`Linear`, module names, `re:` patterns"])
        groups.append((targets, Fp8Scheme(weights, activations, block)))
    if not groups:
        raise unsupported("compressed-tensors config without `config_groups`", qc.get("config_groups"),
                          ["at least one fp8 config group"])
    return QuantConfig(NAME, qc.get("format") or "float-quantized", tuple(groups), tuple(qc.get("ignore") or ()),
                       notes=tuple(notes))
