"""`hetserve plan --model DIR`: per device, which attention each layer type of the model gets, and why.

Design: the model's side comes from the workers' own reading of its config.json
(`python -m workers.model.describe DIR`, one child: the router holds no torch), the device's side
from its plan (the `PagedAttention` kernel it selects); this module only joins them, per layer type
(full or sliding attention): the decode kernel, the prefill path, and which KV blocks the layer
keeps. Kernel layers the model does not contain are marked `unused`, with why (`workers.contract.kernel_layers`).
With several models, each device's plan is that of the model placed on it.
Trade-off: a child process per model described."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from server.errors import UsageError
from server.fleet.spec import worker_id
from workers.contract import DeviceInfo, human
from workers.contract.kernel_layers import unused_layers

DESCRIBE_TIMEOUT_S = 300


def describe_model(model_dir: str) -> dict:
    """The workers' description of a model directory (`workers.model.describe`); `UsageError`
    naming the problem when the directory cannot be served."""
    cmd = [sys.executable, "-m", "workers.model.describe", model_dir]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DESCRIBE_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise UsageError(f"reading `--model {model_dir}` took over {DESCRIBE_TIMEOUT_S} s") from e
    if proc.returncode != 0:
        why = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        raise UsageError(f"`--model {model_dir}`: {why}")
    return json.loads(proc.stdout)


def _decode_reason(kernel: dict, device_type: str, window: int | None, attn: dict, lt: dict) -> str:
    gpu = device_type != "cpu" and kernel["variant"] != "torch"
    parts = [("Triton kernel reads the blocks in place" if gpu else "torch SDPA over the gathered blocks")]
    if window is not None:
        parts.append(f"only the last {window} positions' blocks")
    if attn.get("softcap"):
        parts.append(f"scores soft-capped at {attn['softcap']:g} " + ("in fp32" if gpu else "(explicit scores)"))
    if attn.get("sinks"):
        parts.append("a learned sink logit per head in each softmax")
    if attn.get("scale") is not None:
        parts.append(f"scale {attn['scale']:.4g}")
    parts.append(f"head_dim {lt.get('head_dim', attn['head_dim'])}")
    return "; ".join(parts)


def attention_plan(entry: dict, described: dict) -> list[dict]:
    """One device's attention per layer type of the described model."""
    kernel, attn = entry["kernels"]["PagedAttention"], described["attention"]
    rows = []
    for lt in attn["layer_types"]:
        window = lt.get("window")
        prefill = "torch SDPA, causal" if not attn.get("softcap") else "torch, explicit soft-capped scores, causal"
        if window is not None:
            prefill += f", {window}-position window"
        rows.append({
            "type": lt["type"], "window": window, "layers": lt["layers"], "nope_layers": lt.get("nope_layers", []),
            "head_dim": lt.get("head_dim", attn["head_dim"]), "kv_heads": lt.get("kv_heads"),
            "kv_shared_layers": lt.get("kv_shared_layers", {}), "k_eq_v": lt.get("k_eq_v", False),
            "decode": {"variant": kernel["variant"], "kernel": f"{kernel['repo']}:{kernel['layer']}",
                       "reason": _decode_reason(kernel, entry["device"]["type"], window, attn, lt)},
            "prefill": prefill,
            "kv_cache": ("every block of a sequence" if window is None
                         else f"about {window} positions of blocks per sequence; older blocks freed")
            + ("; the layers reading an earlier layer's KV hold none" if lt.get("kv_shared_layers") else ""),
        })
    return rows


def attach(entry: dict, described: dict, quantize: str = "none") -> None:
    """Add the model's attention plan to a device's entry, and mark the kernel layers it lacks
    (`unused`, with why: `workers.contract.kernel_layers`)."""
    entry["attention"] = attention_plan(entry, described)
    linear = described["attention"].get("linear")
    if linear is not None:  # Gated DeltaNet layers (Qwen3.5, Qwen3-Next): a state per sequence, no KV
        kernel = entry["kernels"]["GatedDeltaRule"]
        entry["linear_attention"] = {**linear, "kernel": {"variant": kernel["variant"],
                                                          "kernel": f"{kernel['repo']}:{kernel['layer']}",
                                                          "reason": kernel["reason"]}}
    device = entry["device"]
    for layer, why in unused_layers(described, device["type"], device["capability"], quantize).items():
        if layer in entry["kernels"]:
            entry["kernels"][layer]["unused"] = why


def render_attention(entry: dict) -> list[str]:
    """Text lines of one device's attention plan (none without `--model`)."""
    lines = []
    linear = entry.get("linear_attention")
    if linear is not None:
        lines.append(f"  linear attention ({linear['kind']}): layers {linear['layers']}, {linear['key_heads']} key "
                     f"heads of {linear['key_head_dim']}, {linear['value_heads']} value heads of "
                     f"{linear['value_head_dim']}")
        lines.append(f"    rule     {linear['kernel']['variant']}  {linear['kernel']['kernel']}")
        lines.append(f"    state    {linear['state']}")
    for row in entry.get("attention", []):
        kind = "full" if row["window"] is None else f"sliding ({row['window']})"
        nope = f", NoPE {row['nope_layers']}" if row["nope_layers"] else ""
        shape = (f", head_dim {row['head_dim']}" + (f", {row['kv_heads']} KV heads" if row.get("kv_heads") else "")
                 + (" (values = keys)" if row.get("k_eq_v") else ""))
        shared = "".join(f", layer {r} reads layer {p}'s KV" for r, p in row.get("kv_shared_layers", {}).items())
        lines.append(f"  attention {kind}: layers {row['layers']}{nope}{shape}{shared}")
        lines.append(f"    decode   {row['decode']['variant']}  {row['decode']['kernel']}  {row['decode']['reason']}")
        lines.append(f"    prefill  {row['prefill']}")
        lines.append(f"    KV cache {row['kv_cache']}")
    return lines


def attach_models(plan: dict, devices: list, raw_models: list[str], raw_place: list[str], dtype: str,
                  quantize: str, pipeline: str = "auto", partition: str | None = None) -> None:
    """Describe each `[NAME=]DIR` (the workers' reading), place them on `devices` as `serve` would
    (`plan["placement"]`, or its error) and give each device the attention plan of its model
    (every device, for one model)."""
    from types import SimpleNamespace

    from server.config.models import models_from_args
    from server.config.settings import check_models
    from server.fleet.placement import ModelAsk, PlacementError, place, split_of
    from workers.contract.model_size import ModelSizeError, read_profile

    config = models_from_args(SimpleNamespace(model=raw_models, place=raw_place, pipeline=pipeline,
                                              pipeline_partition=partition))
    check_models(config)  # one line naming what is unsupported, before any child reads the model
    described, asks = {}, []
    for entry, raw in zip(config.entries, raw_models, strict=True):
        bare = "=" not in raw and Path(raw).expanduser().resolve() == entry.path  # not a GGUF's prepared directory
        described[entry.name] = describe_model(raw if bare else str(entry.path))
        try:
            profile = read_profile(entry.path)
        except ModelSizeError as e:
            raise UsageError(f"`--model {raw}`: {e}") from e
        asks.append(ModelAsk(entry.name, profile, config.pins_of(entry.name)))
    try:
        placement = place(asks, devices, dtype, quantize, split=split_of(SimpleNamespace(models=config)))
        plan["placement"] = placement.to_dict()
        served = [s.model for s in placement.slots]
    except PlacementError as e:
        plan["placement"] = {"error": str(e)}
        served = [None] * len(devices)
    rows = [{"name": e.name, "path": raw, "architecture": described[e.name]["architecture"],
             "features": described[e.name]["features"]} for e, raw in zip(config.entries, raw_models, strict=True)]
    if len(rows) == 1:
        plan["model"] = {k: v for k, v in rows[0].items() if k != "name"}
        for entry in plan["devices"]:
            attach(entry, described[rows[0]["name"]], quantize)
        return
    plan["models"] = rows
    for entry, name in zip(plan["devices"], served, strict=True):
        entry["model"] = name
        if name is not None:
            attach(entry, described[name], quantize)


def render_placement(placement: dict | None, devices: list[dict]) -> list[str]:
    """The placement's text, one line per device (`devices`: the plan's entries): the model it
    serves, its role, why and the bytes, then each pipeline's stages; without `--model`, or where
    placement failed, each device says it serves nothing."""
    if placement is not None and "error" not in placement:
        summary = "; ".join(f"{m} on {', '.join(ids)}" for m, ids in placement["models"].items())
        lines = [f"placement: {summary}"]
        lines += [f"{_device_label(slot['device'])}: {slot['model'] or 'free'} [{slot['role']}] {slot['reason']}"
                  for slot in placement["devices"]]
        for group in placement.get("pipelines", []):  # one replica over several devices: each stage's share
            lines.append(f"pipeline {group['model']}: {group['reason']}")
            lines += [f"  stage {i} {st['worker_id']} ({st['capability'] or 'cpu'}): layers {st['layers'][0]}:"
                      f"{st['layers'][1]}, {human(st['weight_bytes'])} of weights and KV "
                      f"({human(st['capacity_bytes'])} usable, speed {st['speed']:g})"
                      for i, st in enumerate(group["stages"])]
        return lines
    if placement is None:
        head = "placement: none without --model; each device below lists every kernel it selects"
        verdict = "no model"
    else:
        head, verdict = f"placement: {placement['error']}", "nothing placed"
    return [head] + [f"{_device_label(e['device'])}: {verdict}" for e in devices]


def _device_label(device: dict) -> str:
    """`  gpu1 (8.6, 24 MiB)`: the worker id, capability and memory that start a placement line."""
    return (f"  {worker_id(DeviceInfo(**device))} ({device['capability'] or 'cpu'}, "
            f"{human(device['memory_total_bytes'])})")
