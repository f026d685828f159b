"""The worker's configuration: one frozen value that the router writes and the worker reads.

`WorkerConfig` (workers/contract/config.py) declares each field once; its JSON round trip, its
command line (generated from the same declarations: every field a flag and back), its checks
(one message naming the flag and its value, as the worker's command line always gave), and the
router's spec producing a file that `python -m workers --config FILE` reads to the same value.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest

from server.config.settings import RouterSettings
from server.errors import UsageError
from server.fleet.spec import build_worker_specs
from tests.router_harness import ROOT
from workers.contract import WorkerConfig, WorkerConfigError, parse_simulate
from workers.contract.config import argument_parser
from workers.main import parse_args

# a value for every field, none of them its default
EVERY_FIELD = WorkerConfig(
    socket="/tmp/w.sock", worker_id="gpu3", model="/models/m", simulate="sm_89", device_index=3,
    device_uuid="GPU-aaaa", dtype="bfloat16", quantize="fp8", gguf_activations="int8", max_batch=8, max_queue=0,
    kv_cache_bytes=1 << 20,
    kv_host_bytes=1 << 24, kv_host_dir="/dev/shm/hetserve-kv-x",
    max_model_len=256, gpu_memory_utilization=0.5, kv_block_size=32, no_prefix_cache=True,
    max_num_batched_tokens=64, deterministic=True, compile="off", speculative="ngram", num_speculative_tokens=3,
    threads=2, status_file="/tmp/w.json",
    parent_pid=42, otlp_endpoint="http://collector:4318", grammar_compile_timeout=0.5, grammar_compile_memory_mib=64,
    grammar_compile_workers=3, grammar_cache_mib=0, pipeline_plan="/tmp/p.json", pipeline_rank=1,
    pipeline_batches=2, pipeline_microbatches=4, preflight="on", slowdown=3.0, prefill_slowdown=4.5,
    lora="a=/tmp/a,b=/tmp/b", max_loras=2,
    max_lora_rank=32,
    max_cpu_loras=12,
)


def test_every_field_differs_from_its_default_in_the_sample():
    default = WorkerConfig(socket="/tmp/other.sock")
    assert [f.name for f in fields(WorkerConfig) if getattr(EVERY_FIELD, f.name) == getattr(default, f.name)] == []


def test_json_round_trip(tmp_path):
    assert WorkerConfig.from_json(EVERY_FIELD.to_json()) == EVERY_FIELD
    assert WorkerConfig.read(EVERY_FIELD.write(tmp_path / "w.json")) == EVERY_FIELD
    assert not list(tmp_path.glob("*.tmp"))  # written through a rename
    minimal = WorkerConfig(socket="/tmp/w.sock")
    assert WorkerConfig.from_dict({"socket": "/tmp/w.sock"}) == minimal == WorkerConfig.from_json(minimal.to_json())
    assert WorkerConfig.from_dict({"socket": "s", "gpu_memory_utilization": 1}).gpu_memory_utilization == 1.0


@pytest.mark.parametrize("raw, needle", [
    ({"socket": "s", "max_bath": 4}, "Unknown worker config key `max_bath`. Accepted: compile, deterministic"),
    ({"socket": "s", "max_batch": "4"}, 'Worker config `max_batch` must be int, got `"4"`'),
    ({"socket": "s", "max_batch": True}, "Worker config `max_batch` must be int, got `true`"),
    ({"socket": "s", "deterministic": 1}, "Worker config `deterministic` must be bool, got `1`"),
    ({"socket": "s", "threads": 1.5}, "Worker config `threads` must be int or null, got `1.5`"),
    ({"socket": None}, "Worker config `socket` must be str, got `null`"),
    ({"max_batch": 4}, "The worker config lacks `socket`"),
    ({"socket": "s", "dtype": "int8"}, "`--dtype int8` is not accepted. Accepted: auto, bfloat16, float16, float32"),
    ({"socket": "s", "compile": "fast"}, "`--compile fast` is not a mode (or `$HETSERVE_COMPILE`). Accepted: auto"),
    ({"socket": "s", "max_queue": -1}, "`--max-queue` must be >= 0, got `-1`"),
    ({"socket": "s", "slowdown": 0.5}, "`--slowdown 0.5` is no slowdown factor. Accepted: a number >= 1"),
    ({"socket": "s", "grammar_compile_workers": 0}, "`--grammar-compile-workers 0` must be at least 1"),
])
def test_an_unknown_ill_typed_or_bad_value_is_refused_by_name(raw, needle):
    with pytest.raises(WorkerConfigError) as e:
        WorkerConfig.from_dict(raw)
    assert needle in str(e.value)


def test_a_file_that_is_not_a_config_names_the_file(tmp_path):
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(WorkerConfigError, match=r"Worker config `.*bad.json`: A worker config is a JSON object"):
        WorkerConfig.read(tmp_path / "bad.json")
    with pytest.raises(WorkerConfigError, match=r"Worker config `.*absent.json` cannot be read"):
        WorkerConfig.read(tmp_path / "absent.json")


def test_every_field_is_a_flag_and_back():
    """Each field is its own flag, with the field's help (`python -m workers --help` lists them)."""
    flags = {a.dest: a for a in argument_parser()._actions}
    for f in fields(WorkerConfig):
        assert f.name in flags and flags[f.name].option_strings == [f"--{f.name.replace('_', '-')}"]
        assert flags[f.name].help and f.metadata["help"][:20].replace("%", "%%") in flags[f.name].help
    assert WorkerConfig.from_argv(EVERY_FIELD.to_argv(), environ={}) == EVERY_FIELD
    assert WorkerConfig.from_argv(["--socket", "s"], environ={}) == WorkerConfig(socket="s")
    assert WorkerConfig(socket="s").to_argv() == ["--socket", "s", "--compile", "auto", "--preflight", "auto"]


def test_flags_override_a_config_file(tmp_path):
    path = EVERY_FIELD.write(tmp_path / "w.json")
    assert parse_args(["--config", str(path)]) == EVERY_FIELD
    got = parse_args(["--config", str(path), "--max-batch", "16", "--compile", "on"])
    assert got == replace(EVERY_FIELD, max_batch=16, compile="on")


def test_the_environment_gives_defaults_only_without_a_file(tmp_path):
    path = WorkerConfig(socket="s").write(tmp_path / "w.json")
    env = {"HETSERVE_COMPILE": "off", "HETSERVE_PREFLIGHT": "on"}
    assert WorkerConfig.from_argv(["--config", str(path)], environ=env) == WorkerConfig(socket="s")
    assert WorkerConfig.from_argv(["--socket", "s"], environ=env) == WorkerConfig(socket="s", compile="off",
                                                                                 preflight="on")


@pytest.mark.parametrize("argv, needle", [
    (["--socket", "s", "--max-batch", "0"], "`--max-batch` must be >= 1, got `0`"),
    (["--socket", "s", "--max-batch", "x"], "argument --max-batch: invalid int value: 'x'"),
    (["--socket", "s", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    ([], "the following arguments are required: --socket (or --config)"),
    (["--config", "/nonexistent/w.json"], "Worker config `/nonexistent/w.json` cannot be read"),
])
def test_a_bad_flag_exits_2_naming_it(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_the_worker_command_line_lists_every_flag():
    done = subprocess.run([sys.executable, "-m", "workers", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    for f in fields(WorkerConfig):
        assert f"--{f.name.replace('_', '-')}" in done.stdout
    assert "--config FILE" in done.stdout and "85% of free GPU memory" in done.stdout


def test_the_routers_spec_writes_the_file_the_worker_reads(tmp_path):
    """`build_worker_specs` -> `WorkerSpec.write_config` -> the worker's own `parse_args` of the
    command the supervisor runs: the same value, with the router's environment resolved into it."""
    base = {"HETSERVE_COMPILE": "off", "HETSERVE_PREFLIGHT": "on", "HETSERVE_SLOWDOWN": "gpu1=3"}
    settings = RouterSettings(worker_command=(sys.executable, "-m", "workers"), max_batch=8, threads=4)
    specs = build_worker_specs(parse_simulate("sm_80,sm_90"), settings, tmp_path, parent_pid=7, base_env=base)
    for spec in specs:
        spec.write_config()
        assert spec.argv == (sys.executable, "-m", "workers", "--config", str(spec.config_path))
        read = parse_args(list(spec.argv[3:]))
        assert read == spec.config and json.loads(spec.config_path.read_text())["socket"] == str(spec.socket_path)
        assert (read.compile, read.preflight, read.max_batch, read.parent_pid) == ("off", "on", 8, 7)
        assert read.simulate == spec.device.simulate_token and read.status_file == str(spec.status_path)
    assert [s.config.slowdown for s in specs] == [1.0, 3.0]
    assert hash(specs[0]) == hash(build_worker_specs(parse_simulate("sm_80,sm_90"), settings, tmp_path, 7, base)[0])


def test_the_router_refuses_a_bad_environment_naming_the_worker():
    settings = RouterSettings(worker_command=("w",))
    with pytest.raises(UsageError, match=r"worker gpu0: Invalid HETSERVE_SLOWDOWN factor `x`"):
        build_worker_specs(parse_simulate("sm_80"), settings, Path("/r"), 1, base_env={"HETSERVE_SLOWDOWN": "x"})
    with pytest.raises(UsageError, match=r"worker gpu0: `\$HETSERVE_COMPILE`|`--compile fast` is not a mode"):
        build_worker_specs(parse_simulate("sm_80"), settings, Path("/r"), 1, base_env={"HETSERVE_COMPILE": "fast"})
