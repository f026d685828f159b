"""What placement knows before any worker starts: simulated memory sizes, the dtype rule and a
model's bytes, read from its files (workers/contract/sizes.py, dtypes.py, model_size.py), each
checked against what the worker itself does."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.checkpoints import make_checkpoint
from workers.contract import DEFAULT_MODEL_DIR, TopologySpecError, parse_simulate, simulated_device
from workers.contract.dtypes import DTYPE_CHOICES, bfloat16_flags, dtype_rule
from workers.contract.model_size import KV_TOKENS, ModelSizeError, need_on, read_profile, usable_bytes
from workers.contract.sizes import SizeError, format_size, human, parse_size

GIB = 1 << 30


# --- sizes and the simulated topology's memory ------------------------------------------------
@pytest.mark.parametrize(("text", "value"), [("24GiB", 24 * GIB), ("512MiB", 512 << 20), ("1.5GiB", 3 * GIB // 2),
                                             ("80GB", 80 * 10**9), ("4096B", 4096), (" 2 tib ", 2 << 40)])
def test_sizes_parse_and_format_back_to_the_same_bytes(text, value):
    assert parse_size(text) == value
    assert parse_size(format_size(value)) == value


@pytest.mark.parametrize("bad", ["", "24", "GiB", "24XB", "0GiB", "-1GiB", "1e3GiB"])
def test_a_bad_size_is_named_with_the_units_accepted(bad):
    with pytest.raises(SizeError) as e:
        parse_size(bad)
    assert f"`{bad}`" in str(e.value) and "GiB" in str(e.value)


def test_human_sizes_read_well():
    assert (human(24 * GIB), human(1536 << 20), human(980)) == ("24 GiB", "1.5 GiB", "980 B")


def test_a_simulated_device_takes_its_memory_from_the_token():
    a10, l40s, mi300, cpu = parse_simulate("sm_86:24GiB,sm_89,gfx942:1TiB,cpu:512MiB")
    assert [d.memory_total_bytes for d in (a10, l40s, mi300, cpu)] == [24 * GIB, 48 * GIB, 1 << 40, 512 << 20]
    assert [d.arch_name for d in (a10, l40s, mi300, cpu)] == ["sm_86", "sm_89", "gfx942", "cpu"]
    # The token a worker gets recreates the device; the catalog's memory needs no size.
    assert [d.simulate_token for d in (a10, l40s, mi300, cpu)] == ["sm_86", "sm_89", "gfx942:1TiB", "cpu:512MiB"]
    small = simulated_device("sm_86:1536MiB", 3)
    assert small.simulate_token == "sm_86:1536MiB" and simulated_device(small.simulate_token, 3) == small


def test_existing_spellings_keep_their_devices():
    """Regression guard for `simulated_device`'s split of `ARCH[:SIZE]`: a bare token is the catalog's device."""
    (d,) = parse_simulate("sm_90")
    assert (d.arch, d.memory_total_bytes, d.simulate_token) == ("sm_90", 80 * GIB, "sm_90")


@pytest.mark.parametrize("bad", ["sm_86:", "sm_86:24", "sm_86:0GiB", "sm_86:24GiB:1", "sm_86:lots"])
def test_a_bad_memory_size_names_the_token(bad):
    with pytest.raises(TopologySpecError) as e:
        parse_simulate(f"sm_80,{bad}")
    assert f"`{bad}`" in str(e.value) and "Accepted" in str(e.value)


def test_a_worker_binds_the_memory_the_router_gave_its_device():
    from workers.device import bind

    bind._bound = None
    try:
        bound = bind.bind_device("sm_86:24GiB", index=1)
        assert bound.memory_total_bytes == 24 * GIB and bound.capability == (8, 6)
    finally:
        bind._bound = None


# --- the dtype rule -------------------------------------------------------------------------
@pytest.mark.parametrize("requested", DTYPE_CHOICES)
@pytest.mark.parametrize("saved", ["bfloat16", "float16", "float32", None, "int8"])
@pytest.mark.parametrize(("device_type", "cap"), [("cpu", None), ("cuda", (7, 5)), ("cuda", (8, 0)), ("cuda", (9, 0))])
def test_the_contract_dtype_rule_is_the_loaders(requested, saved, device_type, cap):
    from workers.model.loader import choose_dtype

    torch_dtype, reason = choose_dtype(requested, saved, device_type, cap)
    assert dtype_rule(requested, saved, device_type, cap) == (str(torch_dtype).removeprefix("torch."), reason)


def test_a_cpu_without_bfloat16_kernels_computes_a_bfloat16_checkpoint_in_float32():
    """Guards `dtype_rule`'s AVX2 branch: on such a CPU a bfloat16 product takes 2-9x float32's time."""
    assert dtype_rule("auto", "bfloat16", "cpu", None, cpu_bf16=True)[0] == "bfloat16"
    name, reason = dtype_rule("auto", "bfloat16", "cpu", None, cpu_bf16=False)
    assert name == "float32" and "no AVX-512, AVX-NE-CONVERT or AMX" in reason
    assert dtype_rule("bfloat16", "bfloat16", "cpu", None, cpu_bf16=False)[0] == "bfloat16"  # asked for: kept
    assert dtype_rule("auto", "bfloat16", "cuda", (8, 0), cpu_bf16=False)[0] == "bfloat16"  # a GPU's own
    zen2 = frozenset("fpu sse sse2 avx fma avx2 bmi2 sha_ni".split())
    assert bfloat16_flags(zen2) is None
    assert bfloat16_flags(zen2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}) == "avx512bw avx512dq avx512vl"
    assert bfloat16_flags(zen2 | {"avx512f", "avx512bw"}) is None  # all three or nothing
    assert bfloat16_flags(zen2 | {"avx_ne_convert"}) == "avx_ne_convert"
    assert bfloat16_flags(zen2 | {"amx_bf16"}) == "amx_bf16"


# --- a model's bytes, from its files -----------------------------------------------------------
@pytest.mark.parametrize(("arch", "overrides"), [
    ("llama", {}), ("llama", {"tie_word_embeddings": True}), ("qwen2", {}), ("mistral", {"num_key_value_heads": 1}),
])
def test_parameters_from_the_safetensors_headers_are_the_workers_count(tmp_path, arch, overrides):
    from workers.model.config import ModelConfig

    path = make_checkpoint(tmp_path / arch, arch, shards=2, **overrides)
    profile = read_profile(path)
    config = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    assert profile.num_parameters == config.num_parameters
    assert profile.kv_elements_per_token == 2 * config.num_hidden_layers * config.kv_size
    assert profile.source.startswith("safetensors headers") and "2 file(s)" in profile.source
    assert profile.context_length == config.context_length


def test_a_directory_with_only_config_json_is_counted_from_its_shapes(tmp_path):
    from workers.model.config import ModelConfig

    shutil.copy(DEFAULT_MODEL_DIR / "config.json", tmp_path / "config.json")
    hf = json.loads((tmp_path / "config.json").read_text())
    counted = read_profile(tmp_path)
    assert counted.source.startswith("config.json")
    assert counted.num_parameters == ModelConfig.from_hf_config(hf).num_parameters
    assert counted.num_parameters == read_profile(DEFAULT_MODEL_DIR).num_parameters


def test_weights_as_the_worker_loads_them_with_and_without_fp8():
    """`need_on`'s weight bytes equal the bytes of the worker's loaded model, and with
    `--quantize fp8` of the model after `quantize_model` (fp8 projections + one scale per row)."""
    from workers.model.loader import load_model
    from workers.quant.fp8_convention import choose_fp8
    from workers.quant.quantize_model import quantize_model

    def nbytes(model) -> int:  # a tied LM head is the embedding: counted once
        unique = {t.data_ptr(): t for t in model.state_dict().values()}
        return sum(t.numel() * t.element_size() for t in unique.values())

    profile = read_profile(DEFAULT_MODEL_DIR)
    loaded = load_model(DEFAULT_MODEL_DIR, "bfloat16")
    plain = nbytes(loaded.model)
    (device,) = parse_simulate("sm_90")
    assert need_on(profile, device, "bfloat16").weight_bytes == plain
    conv, _ = choose_fp8("cuda", (9, 0))
    quantize_model(loaded.model, conv)
    stored = nbytes(loaded.model)
    assert need_on(profile, device, "bfloat16", "fp8").weight_bytes == stored < plain


def test_a_need_is_weights_in_the_devices_dtype_plus_one_sequence_of_kv(tmp_path):
    path = make_checkpoint(tmp_path / "m", torch_dtype="float16", max_position_embeddings=8192)
    profile = read_profile(path)
    t4, h100, cpu = parse_simulate("sm_75,sm_90,cpu")
    on_t4, on_h100, on_cpu = (need_on(profile, d) for d in (t4, h100, cpu))
    assert (on_t4.dtype, on_h100.dtype, on_cpu.dtype) == ("float16", "float16", "float32")
    assert on_cpu.weight_bytes == 2 * on_t4.weight_bytes == 2 * 2 * profile.num_parameters
    assert on_t4.kv_tokens == KV_TOKENS and on_t4.kv_bytes == profile.kv_elements_per_token * 2 * KV_TOKENS
    assert on_t4.total == on_t4.weight_bytes + on_t4.kv_bytes and "float16" in on_t4.describe()
    assert usable_bytes(t4) == int(0.9 * 16 * GIB)


CONFIG = (DEFAULT_MODEL_DIR / "config.json").read_text()


@pytest.mark.parametrize(("files", "needle"), [
    ({}, "config.json"), ({"config.json": "{"}, "not valid JSON"), ({"config.json": "{}"}, "lacks `hidden_size`"),
    ({"config.json": CONFIG, "model.safetensors": "xx"}, "not a safetensors file"),
])
def test_an_unreadable_model_directory_is_named(tmp_path, files, needle):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ModelSizeError) as e:
        read_profile(tmp_path)
    assert needle in str(e.value) and str(tmp_path) in str(e.value)


@pytest.mark.parametrize("fmt", ["gptq", "awq", "pack-quantized"])
def test_a_4bit_checkpoint_is_sized_as_its_widened_weights(tmp_path, fmt):
    """Guards the `packed4_params` widening in `need_on`: below sm_75 4-bit layers dequantize at load, so
    placement sized a 4-bit checkpoint at its packed bytes, about a quarter of what the worker
    then holds. The need is at least the loaded model's bytes (scales and zero points on top).
    (Where the packed weights stay: tests/test_int4_execution.py.)"""
    from tests.family_checkpoints import make_family_checkpoint
    from tests.int4_checkpoints import quantize_checkpoint
    from workers.model.loader import load_model

    src = make_family_checkpoint("llama", tmp_path / "src")
    ckpt, _ = quantize_checkpoint(src, tmp_path / fmt, fmt, 32, fmt != "awq", False, (), False)
    profile = read_profile(ckpt)
    assert profile.packed4_params > 0
    loaded = load_model(ckpt, "bfloat16", device_type="cuda", capability=(7, 0))  # loaded as an sm_70 worker
    unique = {t.data_ptr(): t for t in loaded.model.state_dict().values()}
    held = sum(t.numel() * t.element_size() for t in unique.values())
    (device,) = parse_simulate("sm_70")
    need = need_on(profile, device, "bfloat16").weight_bytes
    assert held <= need <= 1.25 * held, (need, held)


def test_fp8_weights_are_widened_only_where_the_device_dequantizes_them(tmp_path):
    """Guards the fp8 widening in `need_on`: below sm_80 (and on CPU) an fp8 checkpoint's weights
    are dequantized at load into the model dtype, so they take two bytes there, one on sm_89."""
    from tests.fp8_checkpoints import block_fp8_checkpoint

    profile = read_profile(block_fp8_checkpoint(tmp_path / "fp8"))
    assert profile.fp8_params > 0
    t4, ada = parse_simulate("sm_75,sm_89")
    widened, native = need_on(profile, t4, "float16"), need_on(profile, ada, "float16")
    assert widened.weight_bytes - native.weight_bytes == profile.fp8_params
