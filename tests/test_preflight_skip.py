"""A worker's preflight compiles only the layers its model runs, and `--jobs` compiles layers in
children with the same records (workers/kernelize/preflight.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import triton.language as tl

from kernels_local.compile_spec import Workload
from kernels_local.mapping import LAYERS
from workers.contract import Capability
from workers.contract.defaults import NO_GGUF_LAYER
from workers.kernelize.preflight import preflight
from workers.main import _never_run
from workers.model.config import ModelConfig

pytestmark = pytest.mark.skipif(type(tl.sum).__name__ == "InterpretedFunction",
                                reason="TRITON_INTERPRET=1: kernels are interpreted, not compiled")
CHEAP = ("RMSNorm", "PagedAttention")  # a few launches each: seconds to compile


def _all_but_cheap() -> dict[str, str]:
    return {layer: f"{layer} is not in this test's model" for layer in LAYERS if layer not in CHEAP}


def test_skipped_layers_are_noted_not_compiled():
    """Guards the `skip` filter: a skipped layer has no records and says why; the others compile."""
    report = preflight("cuda", Capability(9, 0), workload=Workload(), skip=_all_but_cheap())
    assert set(report.layers) == set(LAYERS) and report.ok
    assert not report.layers["GGUFLinear"].records
    assert report.layers["GGUFLinear"].note == "not compiled: GGUFLinear is not in this test's model"
    assert all(report.layers[layer].records for layer in CHEAP)


def test_layers_compiled_in_children_give_the_same_records():
    """Guards `_layers_in_children`: `jobs=2` returns what one process compiles, record for record."""
    one = preflight("cuda", Capability(8, 0), workload=Workload(), skip=_all_but_cheap())
    two = preflight("cuda", Capability(8, 0), workload=Workload(), skip=_all_but_cheap(), jobs=2)
    assert one.to_dict() == two.to_dict()


def test_a_dense_model_never_runs_experts_linear_attention_or_gguf_blocks():
    import json

    from workers.contract.defaults import DEFAULT_MODEL_DIR

    config = ModelConfig.from_hf_config(json.loads((DEFAULT_MODEL_DIR / "config.json").read_text()))
    loaded = SimpleNamespace(config=config, model=None, quantization=None)
    never = _never_run(loaded, SimpleNamespace(type="cuda", capability=Capability(9, 0)), "none")
    assert never["GGUFLinear"] == NO_GGUF_LAYER
    assert "FusedMoE" in never and "GatedDeltaRule" in never and "PagedAttention" not in never
    assert {"Fp8Linear", "Fp8CheckpointLinear", "Fp8FusedMoE", "Int4CheckpointLinear", "Mxfp4FusedMoE"} <= set(never)
    assert "LoraDelta" not in never  # adapters may be loaded while it serves
    quantized = _never_run(loaded, SimpleNamespace(type="cuda", capability=Capability(9, 0)), "fp8")
    assert "Fp8Linear" not in quantized and "Fp8CheckpointLinear" in quantized
