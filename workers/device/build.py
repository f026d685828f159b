"""Can the installed torch drive the bound device? Checked at bind, before anything runs on it.

Design: a torch build carries machine code for a list of architectures
(`torch.cuda.get_arch_list()`). A CUDA device of capability A.B runs code built for `sm_A.Y`
with Y <= B or PTX `compute_XY` with XY <= AB; ROCm runs only its own `gfxNNN`. Without any, the
first kernel fails deep inside a load with "no kernel image is available"; here it fails at `bind`
with the reason and the build to install (PyPI's torch 2.13 wheels are for CUDA 13, sm_75 and
newer, driver 580 or newer, so a Volta or Pascal card needs a CUDA 12 build, download.pytorch.org's
cu126 index). Trade-off: the rule is CUDA's documented compatibility, not a trial launch, so a
build whose list is wrong about itself would pass; the preflight and the self-test still run
kernels before ready."""

from __future__ import annotations

import re

_SM = re.compile(r"^sm_(\d+)(\d)[a-z]?$")
_PTX = re.compile(r"^compute_(\d+)(\d)[a-z]?$")
CU126_INDEX = "https://download.pytorch.org/whl/cu126"


def runs_on(arch_list: list[str], kind: str, capability: tuple[int, int], arch: str | None = None) -> bool:
    """Whether code in `arch_list` runs on a `kind` device of `capability` (ROCm: its `arch`)."""
    if kind == "rocm":
        return arch is not None and arch in arch_list
    major, minor = capability
    for entry in arch_list:
        if (m := _SM.match(entry)) and int(m.group(1)) == major and int(m.group(2)) <= minor:
            return True
        if (m := _PTX.match(entry)) and (int(m.group(1)), int(m.group(2))) <= (major, minor):
            return True
    return False


def build_error(arch_list: list[str], kind: str, capability: tuple[int, int], name: str, torch_version: str,
                cuda_version: str | None, arch: str | None = None) -> str | None:
    """None when the build runs on the device, else the reason and what to install."""
    if not arch_list or runs_on(arch_list, kind, capability, arch):
        return None
    built = ", ".join(arch_list)
    if kind == "rocm":
        return (f"The installed torch {torch_version} is built for `{built}`, not for this {name} (`{arch}`): "
                f"install a ROCm build of torch that lists `{arch}`")
    sm = f"sm_{capability[0]}{capability[1]}"
    advice = (f"install a torch built for CUDA 12 (`pip install torch --index-url {CU126_INDEX}`), which still "
              f"targets it" if capability < (7, 5) else "install a torch build that lists it")
    return (f"The installed torch {torch_version} (CUDA {cuda_version}) is built for `{built}`; this {name} is "
            f"`{sm}`, which none of them runs on: {advice}")


def torch_build_error(dev, torch) -> str | None:
    """Why the installed torch cannot drive the bound `dev` (bind raises it as `DeviceBindError`), or None."""
    kind = "rocm" if torch.version.hip is not None else "cuda"
    return build_error(list(torch.cuda.get_arch_list()), kind, tuple(dev.capability), dev.name, torch.__version__,
                       torch.version.cuda, dev.arch)
