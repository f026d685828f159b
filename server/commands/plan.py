"""`hetserve plan`: which model each device serves, then per device the fp8 convention and the
kernel each layer of that model gets, with reasons, without loading weights.

Design: the plan runs the workers' own pure decision functions (`kernels_local.mapping.select`,
the fp8 rule `workers.contract.fp8_rule`) and the fleet's placement on the router's inventory
(NVML or `--simulate`), so it shows what each worker will choose, not a copy of the rules. Field
names match `/workers`. It reads top-down: the placement, one line per device, then per device
only the kernels its model runs (`--all-kernels` and `--json` list them all); `--model` adds the
attention plan (`plan_model`), `--compile` each device's preflight (`plan_compile`).
Trade-off: `select` reads the mapping through the `kernels` library, which imports torch, so this
one-shot command pays that import (the serving router never imports this module)."""

from __future__ import annotations

import json

from server.commands.plan_compile import render_layer, render_preflight
from server.commands.plan_model import render_attention, render_placement
from server.errors import UsageError
from workers.contract import DeviceInfo, TopologySpecError, cpu_device, fp8_rule, select_devices


def _devices(simulate: str | None, devices: str | None) -> list[DeviceInfo]:
    from server.commands.inventory import inventory

    try:
        found = inventory(simulate)
        return select_devices(found, devices) if found else [cpu_device()]
    except TopologySpecError as e:
        raise UsageError(str(e)) from e


def speed_estimate(dev: DeviceInfo) -> dict | None:
    """What bounds the device's prefill (compute) and decode (bandwidth) before anything ran on it:
    its architecture's catalog card (workers/contract/catalog.py); None for a CPU or an
    architecture the catalog has no card for."""
    from workers.contract.catalog import card

    known = card(dev.arch or (dev.capability.sm if dev.capability is not None else "cpu"))
    if known is None:
        return None
    return {"card": known.name, "prefill_tflops": known.tflops, "decode_gbs": known.gbs,
            "reason": f"published figures of {known.name}, the catalog's card for {known.arch} (nothing measured yet)"}


def plan_device(dev: DeviceInfo) -> dict:
    """One device's plan: its description, fp8 convention and kernel per layer."""
    from kernels_local.mapping import select

    fp8 = fp8_rule(dev.type, dev.capability)
    return {
        "device": dev.to_dict(),
        "fp8": {"convention": fp8.convention, "reason": fp8.reason},
        "kernels": {layer: c.to_dict() for layer, c in select(dev.type, dev.capability).items()},
    }


def build_plan(simulate: str | None = None, devices: str | None = "all", compile: bool = False,
               model: str | list[str] | None = None, place: list[str] | None = None, dtype: str = "auto",
               quantize: str = "none", pipeline: str = "auto", partition: str | None = None) -> dict:
    """`{"devices": [plan_device(d), ...]}` for the inventory (or one CPU device); with
    `compile`, each entry carries its preflight; with `model` (a directory, or several
    `[NAME=]DIR`), each model's architecture, its placement (`placement`, pinned by `place`),
    each device's `speed_estimate` and its attention per layer type for its model
    (`server.commands.plan_model`)."""
    found = _devices(simulate, devices)
    plan = {"devices": [plan_device(d) for d in found]}
    models = [model] if isinstance(model, str) else list(model or [])
    if models:  # what its placement weighs each device by (before anything ran on it)
        from server.commands import plan_model

        for entry, dev in zip(plan["devices"], found, strict=True):
            entry["speed"] = speed_estimate(dev)
        plan_model.attach_models(plan, found, models, place or [], dtype, quantize, pipeline, partition)
    if compile:
        from server.commands.plan_compile import attach, preflight_reports

        for entry, report in zip(plan["devices"], preflight_reports(found), strict=True):
            attach(entry, report)
    return plan


def _render(plan: dict, all_kernels: bool = False) -> str:
    """The text plan, top-down: the placement (one line per device), the models, then per device its
    fp8 convention and the kernels its model runs, each with its variant and reason (every kernel,
    the unused ones with why, with `all_kernels`)."""
    lines = render_placement(plan.get("placement"), plan["devices"]) + [""]
    for m in [plan["model"]] if "model" in plan else plan.get("models", []):
        feats = ", ".join(f"{k} {v}" for k, v in m["features"].items())
        named = f"{m['name']} = " if "models" in plan else ""
        lines += [f"model {named}{m['path']}: {m['architecture']} ({feats})"]
    lines += [""] if "model" in plan or plan.get("models") else []
    served = _served(plan)
    for entry in plan["devices"]:
        uuid = entry["device"]["uuid"]
        lines += render_device(entry, all_kernels, uuid not in served or served[uuid] is not None,
                               served.get(uuid) or entry.get("model")) + [""]
    return "\n".join(lines).rstrip("\n")


def _served(plan: dict) -> dict[str, str | None]:
    """Per device UUID, the model the placement gives it (None: free); empty without a placement."""
    placement = plan.get("placement") or {}
    return {slot["device"]["uuid"]: slot["model"] for slot in placement.get("devices", [])}


def render_device(entry: dict, all_kernels: bool = False, serves: bool = True, model: str | None = None) -> list[str]:
    """One device's section: its line (with the `model` it serves), the fp8 convention and the
    kernels listed (those its model runs, none where it `serves` nothing; every one with
    `all_kernels`), each followed by its compile records, and a line naming those left out; then
    its attention and preflight."""
    d = entry["device"]
    cap = f"capability {d['capability']}" if d["capability"] else "no GPU capability"
    sim = ", simulated" if d["simulated"] else ""
    lines = [f"device {d['index']}: {d['name']} [{d['type']}, {cap}{sim}] {d['uuid']}"
             + (f" serves {model}" if model else "" if serves else " serves no model")]
    shown, hidden = split_kernels(entry, serves, all_kernels)
    rows = [("fp8", entry["fp8"]["convention"], "", entry["fp8"]["reason"])]
    if entry.get("speed"):
        sp = entry["speed"]
        rows.append(("speed", f"{sp['prefill_tflops']:g} TFLOPS", f"{sp['decode_gbs']:g} GB/s", sp["reason"]))
    rows += [(layer, k["variant"], f"{k['repo']}:{k['layer']}",
              k["reason"] if "unused" not in k else f"not used: {k['unused']}") for layer, k in shown.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r, kernel in zip(rows, [None] * (len(rows) - len(shown)) + list(shown.values()), strict=True):
        lines.append("  " + "  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3])
        lines += [] if kernel is None else render_layer(kernel)
    lines += _left_out(hidden, serves)
    if serves or all_kernels:
        lines += render_attention(entry)
    return lines + render_preflight(entry)


def split_kernels(entry: dict, serves: bool = True, all_kernels: bool = False) -> tuple[dict, dict]:
    """(listed, left out) of a device's kernels: listed, those its model runs (all of them without a
    model to tell); left out, the ones it does not, or every one on a device that serves nothing."""
    kernels = entry["kernels"]
    if all_kernels:
        return dict(kernels), {}
    if not serves:
        return {}, dict(kernels)
    return ({n: k for n, k in kernels.items() if "unused" not in k},
            {n: k for n, k in kernels.items() if "unused" in k})


def _left_out(hidden: dict, serves: bool) -> list[str]:
    if not hidden:
        return []
    refused = [n for n, k in hidden.items() if k.get("compiled") and not k["compiled"].get("ok", True)]
    why = "its model does not run them" if serves else "it serves no model"
    return [f"  not listed ({why}; --all-kernels lists them): {', '.join(hidden)}"
            + (f"; REFUSED by preflight: {', '.join(refused)}" if refused else "")]


def run(args) -> int:
    compile_ = getattr(args, "compile", False)
    plan = build_plan(getattr(args, "simulate", None), getattr(args, "devices", "all"), compile_,
                      getattr(args, "model", None), getattr(args, "place", None), getattr(args, "dtype", "auto"),
                      getattr(args, "quantize", "none"), getattr(args, "pipeline", "auto"),
                      getattr(args, "pipeline_partition", None))
    if getattr(args, "json", False):
        print(json.dumps(plan, indent=2))
    else:
        print(_render(plan, getattr(args, "all_kernels", False)))
    refused = [e for e in plan["devices"] if compile_ and not e["preflight"]["ok"]]
    return 1 if refused or "error" in plan.get("placement", {}) else 0
