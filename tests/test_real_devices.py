"""Devices as they really are: AMD GPUs from the driver's KFD topology (recorded sysfs trees of an
MI300X host and a mixed host), pinned by ROCr's unique id, and a card the installed torch
cannot drive refused at bind with the reason and the build to install."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import server.commands.inventory as inventory_mod
from server.commands.inventory import inventory
from server.commands.inventory_amd import gfx_arch, kfd_inventory
from server.fleet.spec import worker_environment
from tests.process_state import unbind_device
from workers.contract import DeviceInfo
from workers.device.bind import DeviceBindError, bind_device
from workers.device.build import CU126_INDEX, build_error, runs_on

CPU_NODE = "cpu_cores_count 96\nsimd_count 0\nmem_banks_count 1\ngfx_target_version 0\nvendor_id 0\ndevice_id 0\n"


def _gpu_node(target: int, device_id: int, unique: int, location: int, vram: int) -> str:
    """A KFD GPU node's properties as the amdgpu driver writes them (a subset of its ~40 keys)."""
    return (f"cpu_cores_count 0\nsimd_count 1216\nmem_banks_count 1\ncaches_count 470\nio_links_count 1\n"
            f"max_waves_per_simd 8\nlds_size_in_kb 64\nwave_front_size 64\narray_count 32\n"
            f"gfx_target_version {target}\nvendor_id 4098\ndevice_id {device_id}\nlocation_id {location}\n"
            f"domain 0\ndrm_render_minor 128\nhive_id 0\nnum_sdma_engines 2\nunique_id {unique}\nnum_xcc 8\n"
            f"max_engine_clk_fcompute 2100\nlocal_mem_size 0\n")


def _record(root: Path, nodes: list[tuple[str, int]]) -> Path:
    """Write a topology tree: one directory per node, VRAM in `mem_banks/0` (`heap_type 1`)."""
    for n, (props, vram) in enumerate(nodes):
        node = root / str(n)
        (node / "mem_banks" / "0").mkdir(parents=True)
        (node / "properties").write_text(props)
        heap = "0" if "simd_count 0" in props else "1"  # system memory on CPU nodes
        (node / "mem_banks" / "0" / "properties").write_text(f"heap_type {heap}\nsize_in_bytes {vram}\nwidth 64\n")
    return root


MI300X_VRAM = 206_141_652_992  # 192 GiB per GPU
UNIQUES = [0x1F2E3D4C5B6A7988 + i for i in range(8)]


@pytest.fixture
def mi300x_host(tmp_path):
    """Two CPU sockets then eight MI300X (gfx942), as an 8-GPU MI300X server lists them."""
    nodes = [(CPU_NODE, 1 << 40), (CPU_NODE, 1 << 40)]
    nodes += [(_gpu_node(90402, 0x74A1, UNIQUES[i], (0x0C + 0x10 * i) << 8, MI300X_VRAM), MI300X_VRAM)
              for i in range(8)]
    return _record(tmp_path / "nodes", nodes)


def test_an_mi300x_host_lists_eight_gfx942_gpus_in_node_order(mi300x_host):
    devices = kfd_inventory(mi300x_host)
    assert [d.index for d in devices] == list(range(8))
    assert {(d.type, d.arch, d.name, tuple(d.capability)) for d in devices} == {
        ("rocm", "gfx942", "AMD Instinct MI300X", (9, 4))}
    assert all(d.memory_total_bytes == MI300X_VRAM and not d.simulated for d in devices)
    assert [d.uuid for d in devices] == [f"GPU-{u:016x}" for u in UNIQUES]
    assert devices[1].pci_bus_id == "00000000:1C:00.0"


def test_a_mixed_host_keeps_each_gpus_own_architecture_after_the_nvidia_ones(tmp_path, monkeypatch):
    """An MI250X (gfx90a: stepping 10 is the hex digit `a`) and an RX 7900 XTX (gfx1100) beside a
    CPU node; NVML's devices come first and the AMD ones are numbered after them."""
    root = _record(tmp_path / "nodes", [
        (CPU_NODE, 1 << 38),
        (_gpu_node(90010, 0x740C, 0xABC, 0x300, 64 << 30), 64 << 30),
        (_gpu_node(110000, 0x744C, 0xDEF, 0x800, 24 << 30), 24 << 30),
    ])
    nvidia = DeviceInfo(index=0, uuid="GPU-aaaa", name="NVIDIA H100", type="cuda", capability=(9, 0),
                        memory_total_bytes=80 << 30, simulated=False, pci_bus_id="00000000:01:00.0")
    monkeypatch.setattr(inventory_mod, "nvml_inventory", lambda: [nvidia])
    devices = inventory(kfd_nodes=root)
    assert [(d.index, d.type, d.arch, d.name) for d in devices] == [
        (0, "cuda", None, "NVIDIA H100"), (1, "rocm", "gfx90a", "AMD Instinct MI250X"),
        (2, "rocm", "gfx1100", "AMD Radeon RX 7900 XTX")]
    assert [tuple(d.capability) for d in devices[1:]] == [(9, 0), (11, 0)]
    assert kfd_inventory(tmp_path / "absent") == []


def test_gfx_target_versions_read_as_architectures():
    assert [gfx_arch(v) for v in (90402, 90010, 90500, 110000, 120001)] == [
        "gfx942", "gfx90a", "gfx950", "gfx1100", "gfx1201"]
    with pytest.raises(ValueError, match="`gfx_target_version 91600`"):
        gfx_arch(91600)


def test_a_rocm_worker_is_pinned_by_its_unique_id_and_sees_no_cuda_variable(mi300x_host):
    """Guards the `ROCR_VISIBLE_DEVICES` branch of `worker_environment`: HIP reads
    CUDA_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES too, so neither may be inherited."""
    dev = kfd_inventory(mi300x_host)[3]
    env = worker_environment(dev, 4, {"CUDA_VISIBLE_DEVICES": "0,1", "HIP_VISIBLE_DEVICES": "5", "PATH": "/bin"})
    assert env["ROCR_VISIBLE_DEVICES"] == f"GPU-{UNIQUES[3]:016x}"
    assert "CUDA_VISIBLE_DEVICES" not in env and "HIP_VISIBLE_DEVICES" not in env and env["PATH"] == "/bin"


PYPI_CU13 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]


def test_which_builds_run_on_which_cards():
    assert runs_on(PYPI_CU13, "cuda", (8, 9))  # sm_86 code runs on sm_89 (same major, lower minor)
    assert runs_on(PYPI_CU13, "cuda", (12, 1)) and runs_on(PYPI_CU13, "cuda", (7, 5))
    assert not runs_on(PYPI_CU13, "cuda", (7, 0)) and not runs_on(PYPI_CU13, "cuda", (6, 1))
    assert runs_on(["sm_80", "compute_80"], "cuda", (9, 0))  # PTX the driver compiles
    assert not runs_on(["sm_80"], "cuda", (9, 0))
    assert (runs_on(["gfx90a", "gfx942"], "rocm", (9, 4), "gfx942")
            and not runs_on(["gfx942"], "rocm", (11, 0), "gfx1100"))


def test_a_volta_card_under_a_cuda_13_torch_gets_the_reason_and_the_build():
    why = build_error(PYPI_CU13, "cuda", (7, 0), "Tesla V100-SXM2-32GB", "2.13.0", "13.0")
    assert "`sm_70`" in why and "Tesla V100" in why and "CUDA 13.0" in why and CU126_INDEX in why
    assert build_error(PYPI_CU13, "cuda", (8, 6), "RTX 3090", "2.13.0", "13.0") is None
    assert build_error([], "cuda", (7, 0), "CPU build", "2.13.0+cpu", None) is None  # nothing listed: nothing to judge
    assert "`gfx1100`" in build_error(["gfx942"], "rocm", (11, 0), "RX 7900 XTX", "2.13.0", None, "gfx1100")


def test_bind_refuses_a_card_the_installed_torch_cannot_drive(monkeypatch):
    """Guards `torch_build_error(dev, torch)` in `_bind_gpu`: a V100 under a torch built for
    sm_75 and newer fails at bind, naming the card, its architecture and what to install."""
    unbind_device()
    props = SimpleNamespace(name="Tesla V100-SXM2-32GB", uuid=None, total_memory=32 << 30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: PYPI_CU13)
    monkeypatch.setattr(torch.version, "hip", None)
    for name in ("HETSERVE_SIMULATE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    try:
        with pytest.raises(DeviceBindError, match="Tesla V100.*`sm_70`.*cu126"):
            bind_device()
        monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: [*PYPI_CU13, "sm_70"])
        assert bind_device().capability == (7, 0)
    finally:
        unbind_device()
