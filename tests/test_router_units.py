"""Pure router decisions: worker environment, balancing and constraints, chat templates, metrics."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.config.settings import RouterSettings
from server.fleet.handle import WorkerHandle
from server.fleet.metrics import merge_worker_metrics
from server.fleet.spec import build_worker_specs, threads_per_worker
from server.protocol.chat import CHATML_TEMPLATE, ChatTemplateError, load_chat_template
from server.routing.filter import (
    OVERLOADED,
    UNAVAILABLE,
    UNSATISFIABLE,
    WAIT,
    ConstraintError,
    Constraints,
    parse_constraints,
)
from tests.routing_helpers import PICK, choose
from workers.contract import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    CapabilityPayload,
    DeviceInfo,
    WorkerState,
    cpu_device,
    parse_simulate,
)

REAL_H100 = DeviceInfo(index=3, uuid="GPU-aaaa-bbbb", name="NVIDIA H100", type="cuda", capability=(9, 0),
                       memory_total_bytes=80 << 30, simulated=False, pci_bus_id="00000000:41:00.0")


def _specs(devices, **kw):
    return build_worker_specs(devices, RouterSettings(worker_command=("python", "-m", "workers"), **kw),
                              Path("/tmp/run"), parent_pid=42, base_env={"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1",
                                                                         "HETSERVE_SIMULATE": "sm_75"})


# --- worker processes --------------------------------------------------------------------
def test_real_gpu_worker_sees_only_its_uuid_and_is_not_simulated():
    (spec,) = _specs([REAL_H100])
    env = spec.environ()
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa-bbbb" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "HETSERVE_SIMULATE" not in env  # inherited value dropped
    assert env["HETSERVE_DEVICE_INDEX"] == "3" and env["HETSERVE_DEVICE_UUID"] == "GPU-aaaa-bbbb"
    assert spec.id == "gpu3" and spec.config.simulate is None
    assert spec.argv[:3] == ("python", "-m", "workers")
    assert spec.config.device_uuid == "GPU-aaaa-bbbb"
    assert spec.config.socket == "/tmp/run/gpu3.sock"


def test_simulated_workers_hide_real_gpus_and_share_the_cpu_threads():
    specs = _specs(parse_simulate("sm_80,sm_89,sm_90"), threads=7)
    assert [s.id for s in specs] == ["gpu0", "gpu1", "gpu2"]
    for spec, token in zip(specs, ("sm_80", "sm_89", "sm_90"), strict=True):
        env = spec.environ()
        assert env["HETSERVE_SIMULATE"] == token and env["CUDA_VISIBLE_DEVICES"] == ""
        assert spec.threads == 2 and spec.config.threads == 2
    assert threads_per_worker(1, 3) == 1


def test_cpu_workers_leave_one_core_to_the_router(monkeypatch):
    """Guards `thread_choice`: workers computing on the CPU a small model (the embedded one) get
    every core but one (the router's and the HTTP side's), real GPUs every core, an explicit
    `threads` wins."""
    import server.fleet.spec as spec_module

    monkeypatch.setattr(spec_module, "available_cpus", lambda: 4)
    (cpu,) = _specs([])
    assert cpu.threads == 3 and cpu.environ()["OMP_NUM_THREADS"] == "3"
    assert [s.threads for s in _specs(parse_simulate("sm_80,sm_90"))] == [1, 1]
    assert _specs([REAL_H100])[0].threads == 4
    assert _specs([], threads=4)[0].threads == 4
    monkeypatch.setattr(spec_module, "available_cpus", lambda: 1)
    assert _specs([])[0].threads == 1


def test_a_large_model_on_the_cpu_computes_on_every_core(monkeypatch, tmp_path):
    """Guards `thread_choice`'s `params >= SMALL_MODEL_PARAMS` branch and `worker_threads`' reading of
    the model the workers start with: a ~100M-weight model's CPU worker gets every core (its step
    outlasts a token's relay many times), the embedded 4M one every core but one; the reason names
    the weights."""
    import server.fleet.spec as spec_module
    from workers.contract.model_size import read_profile

    monkeypatch.setattr(spec_module, "available_cpus", lambda: 2)
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 1024,
        "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
        "vocab_size": 32000, "max_position_embeddings": 2048}))
    assert read_profile(big).num_parameters >= spec_module.SMALL_MODEL_PARAMS
    settings = RouterSettings(worker_command=("python", "-m", "workers"), model_dir=big)
    (spec,) = build_worker_specs([], settings, Path("/tmp/run"), parent_pid=42, base_env={})
    assert spec.threads == 2 and spec.environ()["OMP_NUM_THREADS"] == "2"
    threads, why = spec_module.worker_threads(settings, [])
    assert threads == 2 and "M weights" in why and "every CPU" in why
    threads, why = spec_module.worker_threads(RouterSettings(worker_command=("python", "-m", "workers")), [])
    assert threads == 1 and "kept for the router" in why
    # a simulated fleet shares every core among its workers (4 cores: 2 each, against 3 // 2 for a small model)
    monkeypatch.setattr(spec_module, "available_cpus", lambda: 4)
    assert [s.threads for s in build_worker_specs(parse_simulate("sm_80,sm_90"), settings, Path("/tmp/run"), 42,
                                                  base_env={})] == [2, 2]


def test_a_gguf_profile_counts_its_packed_weights():
    """Guards `ModelProfile.num_parameters`' `+ self.gguf_params`: a GGUF file's packable blocks count as
    weights (the thread rule and `/v1/models`' size read it), not only its floating tensors."""
    from workers.contract.model_size import ModelProfile

    profile = ModelProfile(path="x", architecture="llama", context_length=1, checkpoint_dtype=None,
                           quantization=None, float_params=4_000_000, projection_params=0, projection_rows=0,
                           stored_params=0, stored_bytes=0, kv_elements_per_token=1, source="GGUF tensor table",
                           gguf_params=90_000_000, gguf_bytes=55_000_000)
    assert profile.num_parameters == 94_000_000


def test_serve_threads_flag_sets_the_workers_threads(monkeypatch):
    """Guards `--threads` (server/cli.py) and its check in `RouterSettings.from_args`: the flag's
    count reaches every CPU worker in place of the cores-less-one default, and a count below one is
    refused by name."""
    import server.fleet.spec as spec_module
    from server.cli import build_parser
    from server.errors import UsageError

    monkeypatch.setattr(spec_module, "available_cpus", lambda: 2)
    settings = RouterSettings.from_args(build_parser().parse_args(["serve", "--threads", "2"]))
    assert settings.threads == 2
    specs = build_worker_specs([], settings, Path("/tmp/run"), 1, base_env={})
    assert [s.threads for s in specs] == [2] and specs[0].environ()["OMP_NUM_THREADS"] == "2"
    assert RouterSettings.from_args(build_parser().parse_args(["serve"])).threads is None
    with pytest.raises(UsageError, match=r"`--threads 0` must be >= 1"):
        RouterSettings.from_args(build_parser().parse_args(["serve", "--threads", "0"]))


def test_each_architecture_gets_its_own_triton_cache(monkeypatch):
    """Guards `use_triton_cache` in server/fleet/spec.py: workers of different architectures
    never share a Triton cache directory; the root is HETSERVE_TRITON_CACHE, else the user's
    TRITON_CACHE_DIR, else Triton's default."""
    devices = parse_simulate("sm_80,sm_89,sm_89,gfx942") + [REAL_H100]
    base = {"PATH": "/bin", "HETSERVE_TRITON_CACHE": "/c"}
    specs = build_worker_specs(devices, RouterSettings(worker_command=("w",)), Path("/tmp/run"), 1, base_env=base)
    dirs = [s.environ()["TRITON_CACHE_DIR"] for s in specs]
    assert dirs == ["/c/sm_80", "/c/sm_89", "/c/sm_89", "/c/gfx942", "/c/sm_90"]
    assert all(s.environ()["HETSERVE_TRITON_CACHE"] == "/c" for s in specs)
    (spec,) = build_worker_specs([REAL_H100], RouterSettings(worker_command=("w",)), Path("/r"), 1,
                                 base_env={"TRITON_CACHE_DIR": "/mine"})  # fmt: skip
    assert spec.environ()["TRITON_CACHE_DIR"] == "/mine/sm_90"
    monkeypatch.setenv("HOME", "/home/u")
    (spec,) = build_worker_specs([REAL_H100], RouterSettings(worker_command=("w",)), Path("/r"), 1, base_env={})
    assert spec.environ()["TRITON_CACHE_DIR"] == "/home/u/.triton/cache/sm_90"


def test_a_worker_started_by_hand_sets_its_own_cache_and_keeps_the_routers():
    from workers.contract import triton_cache_dir, use_triton_cache

    env = {}
    assert use_triton_cache("gfx950", env) == Path(env["TRITON_CACHE_DIR"]) == Path.home() / ".triton/cache/gfx950"
    env = {"TRITON_CACHE_DIR": "/c/sm_89", "HETSERVE_TRITON_CACHE": "/c"}  # what the router set
    assert use_triton_cache("sm_89", env) == Path("/c/sm_89") and env["TRITON_CACHE_DIR"] == "/c/sm_89"
    env = {"TRITON_CACHE_DIR": "/c/sm_89"}  # a router's directory without the root variable
    assert use_triton_cache("sm_89", env) == Path("/c/sm_89")
    with pytest.raises(ValueError, match="`../x`"):
        triton_cache_dir("../x", {})


def test_workers_entry_shows_compile_records_and_the_cache():
    """The router passes each layer's `compiled` record and the worker's cache directory through
    from `/capability` to `/workers`; a worker without a preflight shows the four plain fields."""
    (spec,) = _specs(parse_simulate("sm_89"))
    handle = WorkerHandle(spec, state=WorkerState.READY)
    compiled = {"target": "sm_89", "shared_bytes": 32768, "instruction": "mma.sync.aligned.m16n8k32", "ok": True}
    kernel = {"repo": "kernels_local/fp8_linear", "layer": "L", "variant": "v", "reason": "r"}
    handle.info = CapabilityPayload(kernels={"Fp8Linear": {**kernel, "compiled": compiled}, "RMSNorm": kernel},
                                    triton_cache="/c/sm_89")  # fmt: skip
    snap = handle.snapshot(4)
    assert snap["kernels"]["Fp8Linear"]["compiled"] == compiled
    assert snap["kernels"]["RMSNorm"] == kernel and snap["triton_cache"] == "/c/sm_89"
    handle.info = None  # before it reported: the directory the router gave it
    assert handle.snapshot(4)["triton_cache"] == spec.environ()["TRITON_CACHE_DIR"]


def test_engine_flags_reach_every_worker_and_bad_ones_are_refused_before_spawning():
    from server.cli import build_parser
    from server.errors import UsageError

    args = build_parser().parse_args(["serve", "--kv-block-size", "32", "--no-prefix-cache",
                                      "--max-num-batched-tokens", "512"])
    settings = RouterSettings.from_args(args)
    assert (settings.kv_block_size, settings.prefix_cache, settings.max_num_batched_tokens) == (32, False, 512)
    config = _specs([REAL_H100], kv_block_size=32, prefix_cache=False, max_num_batched_tokens=512)[0].config
    assert config.kv_block_size == 32 and config.no_prefix_cache
    assert config.max_num_batched_tokens == 512
    defaults = _specs([REAL_H100])[0].config
    assert not defaults.no_prefix_cache and defaults.kv_block_size == 16
    # without the flag each device's step budget (`step_token_budget`): a GPU's, or a CPU's where the
    # step computes there
    assert defaults.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    on_cpu = _specs([cpu_device()])[0].config
    assert on_cpu.max_num_batched_tokens == CPU_MAX_NUM_BATCHED_TOKENS
    for bad, needle in ((["--kv-block-size", "12"], "`--kv-block-size 12` is not supported. Supported: 1, 2, 4"),
                        (["--max-num-batched-tokens", "8"],
                         "`--max-num-batched-tokens 8` must be >= `--max-batch 32`")):
        with pytest.raises(UsageError, match=needle):
            RouterSettings.from_args(build_parser().parse_args(["serve", *bad]))


def test_workers_capacity_merges_the_live_free_blocks_from_health():
    (spec,) = _specs([REAL_H100])
    handle = WorkerHandle(spec, info=CapabilityPayload(capacity={"kv_block_size": 16, "kv_blocks_total": 100,
                                                                 "kv_blocks_free": 100, "prefix_cache": True}))
    handle.live_capacity = {"kv_blocks_free": 37}
    assert handle.snapshot(32)["capacity"] == {"kv_block_size": 16, "kv_blocks_total": 100, "kv_blocks_free": 37,
                                               "prefix_cache": True}
    assert WorkerHandle(spec).snapshot(32)["capacity"] is None


def test_no_device_gives_one_cpu_worker():
    (spec,) = _specs([])
    env = spec.environ()
    # the host CPU is a real device: no simulate token, and no GPU visible to the worker
    assert spec.id == "cpu0" and "HETSERVE_SIMULATE" not in env and env["CUDA_VISIBLE_DEVICES"] == ""
    assert spec.config.simulate is None and spec.device.capability_label == "cpu"
    assert spec.device.simulated is False


# --- balancing ---------------------------------------------------------------------------
def _handles(spec="sm_80,sm_89,sm_90", state=WorkerState.READY):
    handles = []
    for s in _specs(parse_simulate(spec)):
        h = WorkerHandle(s, state=state)
        h.client = object()  # routable
        h.generation = 1
        native = s.device.capability >= (8, 9)
        h.info = CapabilityPayload(fp8={"convention": "native_e4m3" if native else "emulated", "reason": "test"})
        handles.append(h)
    return handles


def test_least_outstanding_wins_and_ties_take_turns():
    hs = _handles()
    hs[0].outstanding, hs[1].outstanding, hs[2].outstanding = 3, 1, 2
    assert choose(hs, Constraints(), capacity=10).worker is hs[1]
    for h in hs:
        h.outstanding = 0
    picked = []
    for _ in range(6):
        d = choose(hs, Constraints(), capacity=10)
        d.worker.picks += 1
        picked.append(d.worker.id)
    assert sorted(picked) == ["gpu0", "gpu0", "gpu1", "gpu1", "gpu2", "gpu2"]


def test_constraints_filter_by_id_capability_and_fp8():
    hs = _handles()
    assert choose(hs, Constraints(worker="gpu2"), 10).worker.id == "gpu2"
    assert choose(hs, Constraints(worker="1"), 10).worker.id == "gpu1"
    assert choose(hs, Constraints(min_capability=(9, 0)), 10).worker.id == "gpu2"
    assert choose(hs, Constraints(fp8="emulated"), 10).worker.id == "gpu0"
    d = choose(hs, Constraints(min_capability=(10, 0)), 10)
    assert d.kind == UNSATISFIABLE and "10.0" in d.reason and "gpu2 has capability 9.0" in d.reason


def test_all_matching_queues_full_is_overloaded_not_a_wait():
    hs = _handles()
    for h in hs:
        h.outstanding = 4
    assert choose(hs, Constraints(), capacity=4).kind == OVERLOADED
    hs[1].outstanding = 3
    assert choose(hs, Constraints(), capacity=4).worker is hs[1]


def test_not_ready_matching_workers_mean_wait_and_excluded_ones_unavailable():
    hs = _handles()
    hs[2].state = "restarting"
    d = choose(hs, Constraints(worker="gpu2"), 10)
    assert d.kind == WAIT and "gpu2 restarting" in d.reason
    hs[2].state = WorkerState.READY
    assert choose(hs, Constraints(worker="gpu2"), 10, exclude={"gpu2": 1}).kind == UNAVAILABLE
    hs[2].generation = 2  # restarted since it failed this request: eligible again
    assert choose(hs, Constraints(worker="gpu2"), 10, exclude={"gpu2": 1}).kind == PICK


def test_a_worker_that_has_not_reported_fp8_is_waited_for():
    hs = _handles()
    hs[1].state, hs[1].info = WorkerState.STARTING, None
    hs[2].state, hs[2].info = WorkerState.STARTING, None
    assert choose(hs, Constraints(fp8="native_e4m3"), 10).kind == WAIT


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, Constraints()),
        ({"x-hetserve-worker": " gpu1 "}, Constraints(worker="gpu1")),
        ({"x-hetserve-min-capability": "8.9"}, Constraints(min_capability=(8, 9))),
        ({"x-hetserve-min-capability": "sm_100"}, Constraints(min_capability=(10, 0))),
        ({"x-hetserve-fp8": "Native"}, Constraints(fp8="native_e4m3")),
    ],
)
def test_constraint_headers_parse(headers, expected):
    assert parse_constraints(headers) == expected


@pytest.mark.parametrize("headers", [{"x-hetserve-min-capability": "9"}, {"x-hetserve-fp8": "e5m2"}])
def test_bad_constraint_headers_name_the_value(headers):
    with pytest.raises(ConstraintError, match=f"`{next(iter(headers.values()))}`"):
        parse_constraints(headers)


# --- chat templates ----------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_chat_template_from_tokenizer_config_with_added_token_dicts(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}"
                         "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}",
    }))
    t = load_chat_template(tmp_path)
    assert t.render(MESSAGES) == "<s>[system] be brief</s>[user] hi</s>[assistant]"


def test_chat_template_jinja_file_wins_and_named_templates_use_default(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]}))
    assert load_chat_template(tmp_path).render(MESSAGES) == "DEFAULT"
    (tmp_path / "chat_template.jinja").write_text("FILE")
    assert load_chat_template(tmp_path).render(MESSAGES) == "FILE"


def test_chat_template_falls_back_to_the_worker_then_chatml(tmp_path):
    assert load_chat_template(tmp_path, {"chat_template": "W{{ messages|length }}"}).render(MESSAGES) == "W2"
    t = load_chat_template(tmp_path)
    assert t.source == CHATML_TEMPLATE and t.render(MESSAGES).endswith("<|im_start|>assistant\n")


def test_chat_template_exceptions_become_named_errors(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"}))
    with pytest.raises(ChatTemplateError, match="first must be user"):
        load_chat_template(tmp_path).render(MESSAGES)


# --- metrics -----------------------------------------------------------------------------
def test_worker_metrics_are_relabelled_and_merged_per_family():
    hs = _handles("sm_80,sm_90")
    text = ("# HELP reqs_total Requests.\n# TYPE reqs_total counter\nreqs_total 3\n"
            "# HELP q Queue.\n# TYPE q gauge\nq{kind=\"waiting\"} 1\n")
    merged = merge_worker_metrics([(hs[0], text), (hs[1], text.replace("3", "5"))])
    assert merged.count("# TYPE reqs_total counter") == 1
    fams = {f.name: f for f in text_string_to_metric_families(merged)}
    totals = {(s.labels["worker_id"], s.labels["capability"]): s.value for s in fams["reqs"].samples}
    assert totals == {("gpu0", "8.0"): 3.0, ("gpu1", "9.0"): 5.0}
    assert {s.labels["kind"] for s in fams["q"].samples} == {"waiting"}


def test_run_dirs_of_dead_routers_are_swept(tmp_path):
    """Guards `shutil.rmtree(d, ...)` in `sweep_stale_run_dirs`: a router killed with SIGKILL
    leaves its private run directory behind; the next router removes it."""
    import subprocess
    import sys

    from server.fleet.run_dir import sweep_stale_run_dirs
    from workers.contract import RUN_DIR_MARKER

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"hetserve-{dead.stdout.strip()}-abc"
    live = tmp_path / f"hetserve-{os.getpid()}-def"
    other = tmp_path / "hetserve-notapid-x"
    for d in (stale, live, other):
        d.mkdir()
        (d / RUN_DIR_MARKER).write_text("")
    assert sweep_stale_run_dirs(tmp_path) == [stale]
    assert not stale.exists() and live.exists() and other.exists()


def test_the_step_budget_is_each_devices_and_never_below_the_batch():
    """`step_token_budget`: 2048 tokens a step on a GPU, 1024 where the step computes on the CPU (a
    CPU, or a simulated device); a `--max-batch` above it raises it, so every running sequence still
    decodes each step."""
    from workers.contract import step_token_budget

    assert step_token_budget(False) == DEFAULT_MAX_NUM_BATCHED_TOKENS == 2048
    assert step_token_budget(True) == CPU_MAX_NUM_BATCHED_TOKENS == 1024
    assert step_token_budget(True, 4096) == 4096
    assert cpu_device().computes_on_cpu and not REAL_H100.computes_on_cpu
    assert parse_simulate("sm_90")[0].computes_on_cpu
