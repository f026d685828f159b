"""The router never initializes CUDA. It never even imports torch, so it cannot
hold a CUDA context or a capability of its own; NVML is its only window on the GPUs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_router_modules_and_inventory_never_import_torch():
    """Imports every module of the `server` package and runs the inventory paths, then checks
    that torch was never imported (no CUDA context is possible without it)."""
    code = textwrap.dedent(
        """
        import importlib, pkgutil, sys
        import server
        from server.cli import main
        from server.commands.inventory import inventory, nvml_inventory
        # `server.commands.plan` is a one-shot command run in its own process, never in the router.
        for m in pkgutil.walk_packages(server.__path__, "server."):
            if m.name != "server.commands.plan":
                importlib.import_module(m.name)
        assert len(inventory("sm_80,sm_89,sm_90")) == 3
        nvml_inventory()  # no driver here: []; with one, NVML only
        assert main(["devices", "--simulate", "sm_80,sm_90", "--json"]) == 0
        bad = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        print("TORCH_MODULES", bad)
        assert not bad, bad
        """
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "TORCH_MODULES []" in r.stdout
