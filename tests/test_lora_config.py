"""`--lora NAME=DIR`, `--max-loras`, `--max-lora-rank` from the router's command line to each
worker's configuration, every bad value a one-line error naming it; the dispatcher puts the
adapter a request's model names into its `WorkerRequest`."""

from __future__ import annotations

import json
import sys

import pytest

from server.cli import build_parser
from server.config.settings import RouterSettings
from server.dispatch.dispatcher import with_lora
from server.errors import UsageError
from server.fleet.spec import build_worker_specs, with_runtime_loras
from server.routing.filter import Constraints
from workers.contract import DEFAULT_MODEL_DIR, WorkerConfig, WorkerConfigError, WorkerRequest, parse_simulate
from workers.contract.config import parse_loras


def _settings(*argv: str) -> RouterSettings:
    return RouterSettings.from_args(build_parser().parse_args(["serve", *argv]))


def _adapter(path):
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    return path


def test_every_worker_of_the_default_model_gets_the_adapters(tmp_path):
    a, b = _adapter(tmp_path / "a"), _adapter(tmp_path / "b")
    settings = _settings("--lora", f"coder={a}", "--lora", f"tone={b}", "--max-loras", "3", "--max-lora-rank", "32")
    assert settings.loras.names == ("coder", "tone")
    settings = RouterSettings(**{**settings.__dict__, "worker_command": (sys.executable, "-m", "workers")})
    for spec in build_worker_specs(parse_simulate("sm_80,sm_90"), settings, tmp_path, parent_pid=7):
        config = spec.config
        assert (config.lora, config.max_loras, config.max_lora_rank) == (f"coder={a},tone={b}", 3, 32)
        assert parse_loras(config.lora) == (("coder", str(a)), ("tone", str(b)))
    assert build_worker_specs(parse_simulate("sm_80"), _settings(), tmp_path, 7)[0].config.lora is None


def test_a_worker_restarted_reads_the_adapters_loaded_at_run_time(tmp_path):
    """`with_runtime_loras`, which the supervisor applies before each start: the adapters loaded at run
    time join `--lora`'s (with the limits), an unload leaves them, another model's worker is untouched."""
    a, late = _adapter(tmp_path / "a"), _adapter(tmp_path / "late")
    settings = _settings("--lora", f"coder={a}", "--max-loras", "2", "--max-cpu-loras", "5")
    settings = RouterSettings(**{**settings.__dict__, "worker_command": (sys.executable, "-m", "workers")})
    spec = build_worker_specs(parse_simulate("sm_80"), settings, tmp_path, parent_pid=7)[0]
    assert spec.config.max_cpu_loras == 5
    grown = with_runtime_loras(spec, settings, {"late": late})
    assert grown.config.lora == f"coder={a},late={late}" and grown.config.max_loras == 2
    assert with_runtime_loras(grown, settings, {}).config.lora == f"coder={a}"
    bare = build_worker_specs(parse_simulate("sm_80"), _settings(), tmp_path, 7)[0]
    assert with_runtime_loras(bare, _settings(), {"late": late}).config.lora == f"late={late}"
    assert with_runtime_loras(with_runtime_loras(bare, _settings(), {"late": late}), _settings(), {}).config.lora \
        is None
    other = bare.__class__(**{**bare.__dict__, "model_dir": tmp_path / "other"})
    assert with_runtime_loras(other, _settings(), {"late": late}) is other


@pytest.mark.parametrize(("argv", "message"), [
    (["--lora", "coder"], r"`--lora coder` is not `NAME=DIR`"),
    (["--lora", "has space=/x"], r"is not `NAME=DIR`"),
    (["--lora", "a=/x", "--lora", "a=/y"], r"`--lora a=...` is given twice"),
    (["--lora", "coder=/nowhere"], r"no `adapter_config.json` in `/nowhere`"),
    (["--max-loras", "0"], r"`--max-loras 0` must be at least 1"),
    (["--max-lora-rank", "0"], r"`--max-lora-rank 0` must be at least 1"),
    (["--max-loras", "4", "--max-cpu-loras", "3"], r"`--max-cpu-loras 3` must be at least `--max-loras` \(4\)"),
])
def test_bad_lora_flags_are_named(argv, message):
    with pytest.raises(UsageError, match=message):
        _settings(*argv)


def test_an_adapter_may_not_take_a_models_name(tmp_path):
    a = _adapter(tmp_path / "a")
    with pytest.raises(UsageError, match=r"`--lora m=...` has a model's name"):
        _settings("--model", f"m={DEFAULT_MODEL_DIR}", "--lora", f"m={a}")


def test_the_worker_config_refuses_a_bad_lora_value():
    with pytest.raises(WorkerConfigError, match=r"`--lora x` is not `NAME=DIR`"):
        WorkerConfig(socket="/tmp/s", lora="x")
    with pytest.raises(WorkerConfigError, match=r"`--max-loras` must be >= 1"):
        WorkerConfig(socket="/tmp/s", max_loras=0)


def test_the_dispatcher_puts_the_adapter_in_the_worker_request():
    """Guards `with_lora` in `Dispatcher.generate` / `open_stream`: the worker learns the adapter only from it."""
    body = WorkerRequest(inputs="hi")
    assert with_lora(body, Constraints(model="m")) is body
    sent = with_lora(body, Constraints(model="m", lora="coder"))
    assert sent.lora == "coder" and sent.inputs == "hi"
    assert WorkerRequest.model_validate_json(sent.model_dump_json()).lora == "coder"
    assert "LoRA adapter `coder`" in Constraints(model="m", lora="coder").describe()


def test_the_pods_lora_gauge_joins_its_workers():
    from server.fleet.metrics import lora_pod

    labels, value = lora_pod([({"running_lora_adapters": "a,b", "waiting_lora_adapters": "", "max_lora": "4"}, 5.0),
                              ({"running_lora_adapters": "b", "waiting_lora_adapters": "c", "max_lora": "2"}, 7.0)])
    assert labels == {"running_lora_adapters": "a,b", "waiting_lora_adapters": "c", "max_lora": "2"} and value == 7.0


def test_lora_modules_dir_serves_each_adapter_subdirectory_by_its_name(tmp_path):
    """Guards `scan_lora_modules_dir` in `loras_from_args`: every subdirectory with an adapter_config.json
    is an adapter named after it; others are skipped; an explicit `--lora` of the same name wins."""
    root = tmp_path / "adapters"
    root.mkdir()
    coder, tone = _adapter(root / "coder"), _adapter(root / "tone")
    (root / "notes").mkdir()  # no adapter_config.json: not an adapter
    (root / "README").write_text("x")
    settings = _settings("--lora-modules-dir", str(root))
    assert settings.loras.adapters == (("coder", coder.resolve()), ("tone", tone.resolve()))
    other = _adapter(tmp_path / "other")
    settings = _settings("--lora", f"tone={other}", "--lora-modules-dir", str(root))
    assert dict(settings.loras.adapters) == {"tone": other.resolve(), "coder": coder.resolve()}


def test_bad_lora_modules_dirs_are_named_with_what_was_found(tmp_path):
    with pytest.raises(UsageError, match=r"`--lora-modules-dir .*` is not a directory"):
        _settings("--lora-modules-dir", str(tmp_path / "nowhere"))
    root = tmp_path / "adapters"
    root.mkdir()
    (root / "notes").mkdir()
    with pytest.raises(UsageError, match=r"holds no adapter .* Found: `notes`"):
        _settings("--lora-modules-dir", str(root))
    _adapter(root / "coder")
    _adapter(root / "bad name")
    with pytest.raises(UsageError, match=r"`bad name` is no adapter name .* Adapters found: `bad name`, `coder`"):
        _settings("--lora-modules-dir", str(root))
    (root / "bad name" / "adapter_config.json").unlink()
    (root / "prefix").mkdir()
    (root / "prefix" / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    with pytest.raises(UsageError, match=r"`prefix` is of PEFT type `PREFIX_TUNING`. Accepted: `LORA`. "
                                         r"Adapters found: `coder`, `prefix`"):
        _settings("--lora-modules-dir", str(root))
    (root / "prefix" / "adapter_config.json").write_text("{not json")
    with pytest.raises(UsageError, match=r"`prefix` has an `adapter_config.json` that is not JSON"):
        _settings("--lora-modules-dir", str(root))
    (root / "prefix" / "adapter_config.json").unlink()
    with pytest.raises(UsageError, match=r"`--lora coder=...` has a model's name"):
        _settings("--model", f"coder={DEFAULT_MODEL_DIR}", "--lora-modules-dir", str(root))
