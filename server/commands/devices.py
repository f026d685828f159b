"""`hetserve devices`: the router's inventory, as a table or JSON."""

from __future__ import annotations

import json

from server.commands.inventory import inventory
from workers.contract import human, select_devices


def run(args) -> int:
    devices = select_devices(inventory(args.simulate), args.devices)
    if args.json:
        listed = [{**d.to_dict(), "pci_bus_id": d.pci_bus_id, "arch": d.arch} for d in devices]
        print(json.dumps({"devices": listed}, indent=2))
        return 0
    if not devices:
        print("No GPU found through NVML; `hetserve serve` will run one CPU worker.")
        return 0
    print(f"{'IDX':<4} {'CAP':<5} {'MEMORY':>9}  {'UUID':<42} NAME")
    for d in devices:
        mem = human(d.memory_total_bytes)
        print(f"{d.index:<4} {d.capability_str or '-':<5} {mem:>9}  {d.uuid:<42} {d.name}")
    return 0
