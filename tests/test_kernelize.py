"""`kernelize_for_device`: the model runs exactly the layers `select()` chose for its bound
device (counters in the layers prove which forward ran), outputs equal the unkernelized
model, and on a real GPU `kernels`' own capability must agree with the bound device."""

from __future__ import annotations

import copy
import sys
from collections import Counter
from pathlib import Path

import kernels.layer.repos as kernels_repos
import pytest
import torch
from kernels import CUDAProperties, Device, LocalLayerRepository, use_kernel_mapping

from kernels_local.mapping import select
from workers.device.bind import BoundDevice
from workers.kernelize.apply import KernelPlan, kernelize_for_device
from workers.kernelize.crosscheck import KernelCapabilityMismatchError
from workers.model.config import ModelConfig
from workers.model.layers import RMSNorm, SiluAndMul
from workers.model.transformer import Transformer

REPOS = Path(__file__).resolve().parents[1] / "kernels_local"
TINY = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
NORMS_PER_FORWARD = 2 * TINY["num_hidden_layers"] + 1
ACTS_PER_FORWARD = TINY["num_hidden_layers"]
PAGED_PER_MODEL = TINY["num_hidden_layers"]  # one decode attention per layer (engine steps only)


def tiny_model(dtype=torch.float32) -> Transformer:
    model = Transformer.random(ModelConfig(**TINY), dtype=dtype, seed=5, std=0.3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.normal_(1.0, 0.2)  # not all ones: the weight multiply is exercised
    return model


def device(token: str, *, simulated: bool = True) -> BoundDevice:
    from workers.contract import parse_token

    dtype, cap = parse_token(token)
    return BoundDevice(type=dtype, index=0, uuid=f"GPU-test-{token}", name=token, capability=cap,
                       memory_total_bytes=0, simulated=simulated)  # fmt: skip


def _layers_module(repo: str, any_layer: str):
    """The `layers` module `kernels` imported for a repository (the one kernelize installs)."""
    cls = LocalLayerRepository(repo_path=REPOS / repo, layer_name=any_layer).load()
    return sys.modules[cls.__module__]


@pytest.fixture
def calls(monkeypatch):
    """Count the launches of the kernel layers, by tuning name ("torch" for the reference, "cpp" for
    the CPU layers' C++ kernels)."""
    seen: Counter = Counter()
    norm_layers = _layers_module("rmsnorm", "RMSNorm")
    act_layers = _layers_module("activation", "SiluAndMul")

    def counting(key_fn, fn):
        def wrapper(*args):
            seen[key_fn(args)] += 1
            return fn(*args)

        return wrapper

    monkeypatch.setattr(
        norm_layers, "rms_norm", counting(lambda a: f"RMSNorm:{a[3].name}", norm_layers.rms_norm)
    )
    monkeypatch.setattr(
        norm_layers, "rms_norm_reference", counting(lambda a: "RMSNorm:torch", norm_layers.rms_norm_reference)
    )
    monkeypatch.setattr(norm_layers, "rms_norm_cpu", counting(lambda a: "RMSNorm:cpp", norm_layers.rms_norm_cpu))
    monkeypatch.setattr(
        act_layers, "silu_and_mul_cpu", counting(lambda a: "SiluAndMul:cpp", act_layers.silu_and_mul_cpu)
    )
    monkeypatch.setattr(
        act_layers, "silu_and_mul", counting(lambda a: f"SiluAndMul:{a[1].name}", act_layers.silu_and_mul)
    )
    monkeypatch.setattr(
        act_layers,
        "silu_and_mul_reference",
        counting(lambda a: "SiluAndMul:torch", act_layers.silu_and_mul_reference),
    )
    return seen


@pytest.mark.parametrize(
    "token,norm_tuning,act_tuning",
    [("sm_80", "sm70", "sm70"), ("sm_90", "sm90", "sm90"), ("sm_120", "sm90", "sm90"), ("gfx942", "rocm", "rocm"),
     ("cpu", "cpp", "cpp")],
)  # fmt: skip
def test_counters_prove_which_forward_ran(calls, token, norm_tuning, act_tuning):
    model, bound = tiny_model(), device(token)
    assert kernelize_for_device(model, bound) == select(bound.type, bound.capability)
    calls.clear()
    model(torch.randint(0, TINY["vocab_size"], (2, 7)))
    assert calls == {
        f"RMSNorm:{norm_tuning}": NORMS_PER_FORWARD,
        f"SiluAndMul:{act_tuning}": ACTS_PER_FORWARD,
    }


def test_attributes_prove_the_chosen_layer_is_installed():
    m80, m90 = tiny_model(), tiny_model()
    kernelize_for_device(m80, device("sm_80"))
    kernelize_for_device(m90, device("sm_90"))
    sm70 = LocalLayerRepository(repo_path=REPOS / "rmsnorm", layer_name="RMSNormTritonSm70").load()
    sm90 = LocalLayerRepository(repo_path=REPOS / "rmsnorm", layer_name="RMSNormTritonSm90").load()
    norms80 = [m for m in m80.modules() if isinstance(m, RMSNorm)]
    norms90 = [m for m in m90.modules() if isinstance(m, RMSNorm)]
    assert len(norms80) == NORMS_PER_FORWARD
    assert all(m.forward.__func__ is sm70.forward for m in norms80)
    assert all(m.forward.__func__ is sm90.forward for m in norms90)
    assert m90.kernel_plan == KernelPlan("cpu", select("cuda", (9, 0)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("token", ["sm_75", "sm_80", "sm_89", "sm_90", "sm_100", "gfx90a", "gfx942", "cpu"])
def test_outputs_match_the_unkernelized_model(token, dtype):
    model = tiny_model(dtype)
    reference = copy.deepcopy(model)
    kernelize_for_device(model, device(token))
    ids = torch.randint(0, TINY["vocab_size"], (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids))


def test_real_gpu_path_kernelizes_for_cuda_when_kernels_agrees(monkeypatch, calls):
    """Only the capability source is faked: `kernels` itself resolves for device "cuda"."""
    monkeypatch.setattr(kernels_repos, "_find_capability", lambda: 90)
    model = tiny_model()
    bound = device("sm_90", simulated=False)
    choices = kernelize_for_device(model, bound)
    assert choices == select("cuda", (9, 0))
    assert model.kernel_plan.device_type == "cuda"
    calls.clear()
    model(torch.randint(0, TINY["vocab_size"], (1, 5)))
    assert calls["RMSNorm:sm90"] == NORMS_PER_FORWARD


def test_real_gpu_refuses_when_kernels_computes_another_capability(monkeypatch):
    """No stale capability: `kernels`' `_find_capability()` (stale at device 0's 8.0) vs a bound 9.0."""
    monkeypatch.setattr(kernels_repos, "_find_capability", lambda: 80)
    model = tiny_model()
    with pytest.raises(KernelCapabilityMismatchError, match="capability `9.0`.*80"):
        kernelize_for_device(model, device("sm_90", simulated=False))
    untouched = [m for m in model.modules() if isinstance(m, (RMSNorm, SiluAndMul))]
    assert all("forward" not in m.__dict__ for m in untouched)
    assert not hasattr(model, "kernel_plan")


def test_same_selection_in_simulation_and_on_a_real_gpu(monkeypatch):
    monkeypatch.setattr(kernels_repos, "_find_capability", lambda: 89)
    sim, real = tiny_model(), tiny_model()
    assert kernelize_for_device(sim, device("sm_89")) == kernelize_for_device(
        real, device("sm_89", simulated=False)
    )
    for a, b in zip(sim.modules(), real.modules(), strict=True):
        if isinstance(a, (RMSNorm, SiluAndMul)):
            assert a.forward.__func__ is b.forward.__func__


def test_a_conflicting_mapping_registered_in_the_process_does_not_win(monkeypatch):
    """Guards `use_kernel_mapping(mapping, inherit_mapping=False)` in `apply_plan`: inheriting
    would merge our choice into whatever mapping the process already registered, and `kernels`
    resolves a CUDA capability to the *narrowest* range, so another module's sm_90-only entry
    would replace the layer `select()` chose for this device."""
    monkeypatch.setattr(kernels_repos, "_find_capability", lambda: 90)
    sm70 = LocalLayerRepository(repo_path=REPOS / "rmsnorm", layer_name="RMSNormTritonSm70")
    sm90_only = Device(type="cuda", properties=CUDAProperties(min_capability=90, max_capability=90))
    model = tiny_model()
    with use_kernel_mapping({"RMSNorm": {sm90_only: sm70}}, inherit_mapping=False):  # registered elsewhere
        choices = kernelize_for_device(model, device("sm_90", simulated=False))
    assert choices["RMSNorm"].layer == "RMSNormTritonSm90"
    sm90 = LocalLayerRepository(repo_path=REPOS / "rmsnorm", layer_name="RMSNormTritonSm90").load()
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == NORMS_PER_FORWARD and all(m.forward.__func__ is sm90.forward for m in norms)


def test_layers_a_plan_does_not_map_keep_their_forward():
    """`apply_plan` kernelizes with `KernelizeFallback.NO_LAYER`: a layer left out of the plan
    keeps its torch forward instead of failing, and only the planned ones are counted."""
    from workers.kernelize.apply import apply_plan

    model = tiny_model()
    only_norm = KernelPlan("cpu", {"RMSNorm": select("cuda", (9, 0))["RMSNorm"]})
    assert apply_plan(model, only_norm) == NORMS_PER_FORWARD
    acts = [m for m in model.modules() if isinstance(m, SiluAndMul)]
    assert acts and all(getattr(m.forward, "__func__", None) is SiluAndMul.forward for m in acts)


def test_verify_catches_a_module_that_runs_another_kernel():
    """Guards the check after kernelize (`_verify`): a module that does not run the planned
    layer's forward is named, with the kernel it should run."""
    from workers.kernelize.apply import KernelizeError, _verify

    model = tiny_model()
    kernelize_for_device(model, device("sm_80"))  # installs the sm70 tuning
    sm90 = KernelPlan("cpu", select("cuda", (9, 0)))
    with pytest.raises(KernelizeError) as info:
        _verify(model, sm90)
    assert str(info.value) == (
        "Module `layers.0.attention_norm` (RMSNorm) does not run the chosen kernel "
        "`kernels_local/rmsnorm:RMSNormTritonSm90` (triton-sm90) after kernelize"
    )
    norm = next(m for m in model.modules() if isinstance(m, RMSNorm))
    with pytest.raises(KernelizeError, match=r"^Module `RMSNorm` \(RMSNorm\) does not run"):
        _verify(norm, sm90)  # a layer verified on its own is named by its class
    assert _verify(model, model.kernel_plan) == NORMS_PER_FORWARD + ACTS_PER_FORWARD + PAGED_PER_MODEL
