"""`python -m workers.kernelize`: the preflight of one device, from the command line.

Compiles every Triton kernel the device selects and checks it against its limits
(workers/kernelize/preflight.py), then prints the report as JSON. Without `--arch` it binds
this process's device (a real GPU compiles for what its driver reports); with `--arch sm_89`
it compiles for that architecture without touching a device. `hetserve plan --compile` runs
one such child per device, each with its own Triton cache; `--compare A.json B.json` names
every record where two reports (say a real device's and its simulation's) disagree, exit 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from kernels_local.compile_spec import Workload
from workers.kernelize.preflight import TRITON_DTYPES, preflight_bound
from workers.kernelize.records import compare


def _as_report(doc: dict) -> dict:
    """A preflight report from this module's JSON, or from `hetserve plan --compile --json` (its
    first device)."""
    if "devices" not in doc:
        return doc
    entry = doc["devices"][0]
    return {"target": entry["preflight"].get("target"),
            "layers": {layer: k.get("compiled", {}) for layer, k in entry["kernels"].items()}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.kernelize",
                                description="Compile every selected Triton kernel for one device and check it.")
    p.add_argument("--arch", help="compile for this architecture (sm_89, gfx942, ...) without touching a device; "
                                  "default: the device this process binds")  # fmt: skip
    p.add_argument("--dtype", choices=tuple(TRITON_DTYPES), help="model dtype (default: a bfloat16 checkpoint's)")
    p.add_argument("--jobs", type=int, default=1, help="processes compiling layers at once (default 1: `hetserve "
                                                       "plan --compile` already runs one child per device)")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="report where two preflights disagree")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.compare:
        a, b = (_as_report(json.loads(Path(f).read_text())) for f in args.compare)
        diffs = compare(a, b)
        print("\n".join(diffs) if diffs else f"agree: {len(a['layers'])} layers on {a['target']}")
        return 1 if diffs else 0
    from workers.contract import TopologySpecError
    from workers.device.bind import bind_device
    from workers.model.loader import choose_dtype

    try:
        bound = bind_device(args.arch)
    except TopologySpecError as e:
        p.error(str(e))
    dtype, _ = choose_dtype(args.dtype or "auto", "bfloat16", bound.type, bound.capability)
    if args.jobs < 1:
        p.error(f"`--jobs {args.jobs}`: at least 1")
    report = preflight_bound(bound, Workload(dtype=TRITON_DTYPES[str(dtype).removeprefix("torch.")]), jobs=args.jobs)
    print(json.dumps(report.to_dict(), indent=2))
    return 0
