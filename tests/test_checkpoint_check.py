"""The router's checkpoint check (workers/contract/checkpoint_check.py): the workers' own tables, one
line and exit 2 from `hetserve serve` and `hetserve plan --model` before any worker starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.router_harness import free_port
from workers.contract import DEFAULT_MODEL_DIR
from workers.contract.checkpoint_check import (
    ARCHITECTURES,
    QUANT_METHODS,
    CheckpointError,
    check_checkpoint,
    check_config,
    supported_architectures,
)

ROOT = Path(__file__).resolve().parent.parent


def _default_config() -> dict:
    return json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())


def test_the_contract_names_every_family_of_the_registry_and_no_other():
    from workers.model.families.registry import FAMILIES
    from workers.model.families.registry import supported_architectures as registry_list

    assert {f.name: (f.architectures, f.model_types) for f in FAMILIES.values()} == ARCHITECTURES
    assert registry_list() == supported_architectures() == sorted(a for f in FAMILIES.values() for a in f.architectures)


def test_the_contract_names_the_quantization_registry_methods():
    from workers.quant import int4_methods
    from workers.quant.registry import METHODS

    assert sorted({*METHODS, *int4_methods.METHODS}) == list(QUANT_METHODS)


def test_the_workers_tables_are_the_contract_ones():
    from workers.contract import checkpoint_check as c
    from workers.model import rope
    from workers.model.families import base

    assert rope.ROPE_TYPES is c.ROPE_TYPES
    assert (base.FULL, base.SLIDING, base.LINEAR, base.LAYER_TYPES) == (c.FULL, c.SLIDING, c.LINEAR, c.LAYER_TYPES)


def test_the_embedded_model_passes():
    assert check_checkpoint(DEFAULT_MODEL_DIR) == "llama"


# one field of the embedded model's config.json changed -> what the one line must name
REFUSED = [
    ({"architectures": ["FooForCausalLM"], "model_type": "foo"}, "Unsupported architecture `FooForCausalLM`",
     "LlamaForCausalLM"),
    ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}, "rope_parameters": None}, "Unsupported rope type `mrope`",
     "yarn"),
    ({"rope_parameters": {"rope_type": "su", "rope_theta": 10000.0}}, "Unsupported rope type `su`", "longrope"),
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "layer_types": ["chunked_attention"] * 4},
     "Unsupported layer type `chunked_attention`", "sliding_attention"),
    ({"hidden_act": "relu2"}, "Unsupported `hidden_act` `relu2`", "gelu_pytorch_tanh"),
    ({"quantization_config": {"quant_method": "hqq"}}, "Unsupported quantization method `hqq`",
     "awq, compressed-tensors, fp8, gptq"),
]


@pytest.mark.parametrize("change,what,listed", REFUSED)
def test_a_refused_config_is_one_line_naming_it_and_the_worker_refuses_it_too(change, what, listed):
    from workers.model.config import ConfigError, ModelConfig
    from workers.quant.registry import read_quantization
    from workers.quant.scheme import UnsupportedQuantizationError

    hf = {**_default_config(), **change}
    with pytest.raises(CheckpointError) as e:
        check_config(hf)
    message = str(e.value)
    assert what in message and listed in message and "\n" not in message, message
    # the same table decides in the worker: it refuses the config too
    if "quantization_config" in change:
        with pytest.raises(UnsupportedQuantizationError):
            read_quantization(hf)
    else:
        with pytest.raises(ConfigError):
            ModelConfig.from_hf_config(hf)


def test_a_multimodal_checkpoint_is_read_through_its_text_config():
    hf = {"architectures": ["Gemma3ForCausalLM"], "text_config": {"rope_scaling": {"rope_type": "mrope"}}}
    with pytest.raises(CheckpointError, match="rope type `mrope`"):
        check_config(hf)


def test_a_directory_without_config_json_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="has no config.json"):
        check_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot be read as JSON"):
        check_checkpoint(tmp_path)


def _unknown_architecture(tmp_path: Path) -> Path:
    model = tmp_path / "foo-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**_default_config(), "architectures": ["FooForCausalLM"],
                                                   "model_type": "foo"}))
    return model


def _hetserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "server.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_serve_refuses_an_unknown_architecture_in_one_line_before_any_worker(tmp_path):
    """Guards `check_models(models)` in server/config/settings.py `RouterSettings.from_args`: without
    it the router binds the port, starts a worker and the worker's load fails with tracebacks."""
    port = free_port()
    proc = _hetserve("serve", "--model", str(_unknown_architecture(tmp_path)), "--port", str(port),
                     "--simulate", "sm_80,sm_90")
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr  # no "starting N worker(s)" line, no worker's log
    assert lines[0].startswith("hetserve serve: error: `--model "), lines
    assert "Unsupported architecture `FooForCausalLM`" in lines[0] and "LlamaForCausalLM" in lines[0]
    assert proc.stdout == ""


def test_plan_refuses_an_unknown_architecture_in_one_line(tmp_path):
    """Guards `check_models(config)` in server/commands/plan_model.py `attach_models`."""
    proc = _hetserve("plan", "--simulate", "sm_80", "--model", str(_unknown_architecture(tmp_path)))
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "Unsupported architecture `FooForCausalLM`" in lines[0] and "Qwen3ForCausalLM" in lines[0]
    assert proc.stdout == ""


def test_a_models_dir_with_an_unsupported_model_names_that_model(tmp_path, capsys):
    """Guards the `--models-dir` wording in server/config/settings.py `check_models`."""
    from server.cli import main

    root = tmp_path / "models"
    root.mkdir()
    _unknown_architecture(root)
    assert main(["serve", "--models-dir", str(root), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hetserve serve: error: `--models-dir {root.resolve()}` holds `foo-model`:"), err
    assert "Unsupported architecture `FooForCausalLM`" in err and "\n" not in err
