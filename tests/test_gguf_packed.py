"""GGUF blocks kept packed in the model's layers (workers/gguf/packed.py, workers/gguf/linear.py).

What must hold:
- on a device whose GGUF rule keeps the blocks packed (a GPU from sm_70, named to the loader as
  a simulated one is; the CPU, whose C++ GEMV decodes the same three types), every projection of
  a Q4_K_M-like file (Q4_K, Q6_K, Q8_0 per tensor) holds its file's bytes, a fused q/k/v of three
  types as one `GGUFLinear` per type, a Qwen3-MoE's stacked experts as `GGUFExperts` (each
  projection's experts stacked, one grouped kernel); the tied head, the F32 routers and the embeddings stay dense; a
  CPU without its kernel loads the same file dequantized; the logits agree in fp32, and the CPU
  kernel's within fp32 rounding;
- the bytes held: each packed layer at its file's bits per weight (Q4_K's 4.5: 0.28x bf16), the
  description's resident bytes smaller than the dequantized model's by exactly the difference;
- under `TRITON_INTERPRET=1` (this file reruns itself in a child with it) the model kernelized for
  sm_80 (the GEMM for a prompt, the GEMV for a decode row) gives the torch path's logits within fp32
  rounding;
- a packed kernel that fails its self-test (the linear layers' or the experts') sends its layers back
  to dense weights, dequantized from the blocks, and the worker's description says so with the reason.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.interpreter import INTERPRETED, needs_interpreter, rerun_under_interpreter
from workers.contract import Capability

gguf = pytest.importorskip("gguf")

from kernels_local.gguf_linear import TYPES  # noqa: E402
from kernels_local.mapping import select  # noqa: E402
from tests.gguf_checkpoints import make_gguf  # noqa: E402
from workers.gguf.execution import PACKED_TYPES, gguf_execution, gguf_layer_unused  # noqa: E402
from workers.gguf.experts import GGUFExperts  # noqa: E402
from workers.gguf.linear import GGUFFusedLinear, GGUFLinear  # noqa: E402
from workers.kernelize.apply import KernelPlan, apply_plan  # noqa: E402
from workers.model.loader import load_model  # noqa: E402

SM80 = Capability(8, 0)
BITS = {"Q4_K": 4.5, "Q6_K": 6.5625, "Q8_0": 8.5}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf-packed")
    return {arch: make_gguf(arch, "Q4_K_M", out) for arch in ("llama", "qwen2", "qwen3moe")}


def _load(path, where: str):
    """`where`: "sm_80" or "sm_61" (simulated: CPU tensors), "cpu", or "dense" (a CPU without its GGUF kernel)."""
    if where == "dense":
        from kernels_local.gguf_linear import cpu

        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(cpu.ENV_CPU_GGUF, "off")
            cpu.KERNEL.reset()
            try:
                return load_model(path, "float32", "cpu")
            finally:
                cpu.KERNEL.reset()
    if where == "cpu":
        return load_model(path, "float32", "cpu")
    cap = SM80 if where == "sm_80" else Capability(6, 1)
    return load_model(path, "float32", "cpu", cap, device_type="cuda")


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 4096, (2, 9), generator=torch.Generator().manual_seed(seed))


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
def test_kernels_run_under_the_interpreter():
    rerun_under_interpreter(__file__)


@pytest.mark.skipif(INTERPRETED, reason="torch paths only: the interpreter child runs the kernels")
def test_the_kernel_decodes_every_type_the_loader_keeps_packed():
    """Guards `PACKED_TYPES`: the loader keeps packed exactly the types the kernel repository decodes."""
    assert set(PACKED_TYPES) == set(TYPES)


@pytest.mark.skipif(INTERPRETED, reason="torch paths only: the interpreter child runs the kernels")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3moe"])
def test_a_packed_device_holds_the_files_blocks_and_the_cpu_its_dequantized_weights(files, arch):
    """Guards the loader's reader (`reader = quant or packed_gguf(...)`): without it every layer is a dense
    `nn.Linear` on sm_80 too."""
    packed, dense = _load(files[arch], "sm_80"), _load(files[arch], "dense")
    layers = [m for m in packed.model.modules() if isinstance(m, GGUFLinear)]
    assert {m.gguf_type for m in layers} == {"Q4_K", "Q6_K", "Q8_0"}
    assert all(m.qweight.dtype == torch.uint8 and m.weight is None for m in layers)
    assert any(isinstance(m, GGUFFusedLinear) for m in packed.model.modules())  # q/k/v of several types
    linears = [n for n, m in packed.model.named_modules() if type(m) is nn.Linear]
    routers = [n for n in linears if n.endswith(".router")]  # F32 in the file, as llama.cpp keeps them
    assert [n for n in linears if n not in routers] == (["output"] if arch == "llama" else [])  # llama's head: tied
    experts = [m for m in packed.model.modules() if isinstance(m, GGUFExperts)]
    assert len(experts) == (2 if arch == "qwen3moe" else 0)  # every MoE layer's experts hold their stacked blocks
    assert not any(isinstance(m, (GGUFLinear, GGUFFusedLinear)) for m in dense.model.modules())
    with torch.no_grad():
        torch.testing.assert_close(packed.model(_ids()), dense.model(_ids()), rtol=1e-5, atol=1e-5)
    assert set(gguf_layer_unused(packed.model)) == (set() if arch == "qwen3moe" else {"GGUFExperts"})
    assert set(gguf_layer_unused(dense.model)) == {"GGUFLinear", "GGUFExperts"}


@pytest.mark.skipif(INTERPRETED, reason="torch paths only: the interpreter child runs the kernels")
def test_the_description_counts_the_packed_layers_and_the_bytes_they_hold(files):
    loaded = _load(files["qwen2"], "sm_80")
    described = gguf_execution(loaded.model_dir, loaded.dtype, "sm_80", None, loaded.model)
    assert described["execution"].startswith("packed (") and described["packed_layers"] > 0
    assert described["reason"].startswith("sm_80: blocks kept packed")
    layers = [m for m in loaded.model.modules() if isinstance(m, GGUFLinear)]
    for m in layers:  # the file's bits per weight, exactly: Q4_K 4.5 (0.28x bf16), Q6_K 6.5625, Q8_0 8.5
        assert m.nbytes() * 8 == m.in_features * m.out_features * BITS[m.gguf_type], m
    dense = gguf_execution(loaded.model_dir, loaded.dtype, "cpu", None, _load(files["qwen2"], "dense").model)
    assert described["resident_bytes"] < dense["resident_bytes"]
    assert dense["resident_bytes"] - described["resident_bytes"] == sum(
        m.in_features * m.out_features * 4 - m.nbytes() for m in layers)


@needs_interpreter
@pytest.mark.parametrize("arch", ["qwen2"])  # biases, an untied head, q/k/v of several types (the interpreter is slow)
def test_the_sm80_kernel_layers_give_the_torch_paths_logits_for_a_prompt_and_a_decode_row(files, arch):
    from workers.kernelize.selftest import reference_path

    loaded = _load(files[arch], "sm_80")
    choice = select("cuda", SM80)["GGUFLinear"]
    assert choice.layer == "GGUFLinearTritonSm80"
    assert apply_plan(loaded.model, KernelPlan("cpu", {"GGUFLinear": choice})) > 0
    ids = _ids(1)
    with torch.no_grad():
        for x in (ids, ids[:1, :1]):  # 18 rows: the GEMM; a decode row: the GEMV (its rows: test_kernels_gguf_linear)
            got = loaded.model(x)
            with reference_path(loaded.model):
                want = loaded.model(x)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@needs_interpreter
def test_the_sm80_kernel_layers_run_a_moe_layers_experts_as_their_torch_path(files):
    """The experts' stacked blocks through the grouped kernel: a decode row (16-row blocks) and a prompt's rows
    (prefill tiles)."""
    from workers.kernelize.selftest import reference_path

    experts = next(m for m in _load(files["qwen3moe"], "sm_80").model.modules() if isinstance(m, GGUFExperts))
    assert apply_plan(experts, KernelPlan("cpu", {"GGUFExperts": select("cuda", SM80)["GGUFExperts"]})) == 1
    g = torch.Generator().manual_seed(2)
    decode = torch.randperm(4, generator=g)[:2][None]  # [1, 2] of 4 experts
    prompt = torch.tensor([[1, 3]] * 40)  # two experts of 40 rows each: more tokens than a decode launch
    for ids in (decode, prompt):
        tokens = ids.shape[0]
        x = torch.randn(tokens, 256, generator=g)
        weights = torch.rand(tokens, 2, generator=g)
        got = experts(x, ids, weights)
        with reference_path(experts):
            want = experts(x, ids, weights)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(INTERPRETED, reason="torch paths only: the interpreter child runs the kernels")
def test_a_packed_kernel_failing_its_self_test_falls_back_to_dequantized_weights(files):
    """Guards `m.fall_back(why)` in workers/kernelize/selftest.py `to_torch_path`: without it the layers keep
    their blocks and the description says nothing of the failure."""
    from workers.kernelize.selftest import self_test_or_fall_back

    loaded, dense = _load(files["qwen2"], "sm_80"), _load(files["qwen2"], "dense")
    apply_plan(loaded.model, KernelPlan("cpu", {"GGUFLinear": select("cuda", SM80)["GGUFLinear"]}))
    for m in loaded.model.modules():  # the kernel as a device that computes nonsense would run it
        if isinstance(m, GGUFLinear):
            m.forward = lambda x, m=m: torch.ones(*x.shape[:-1], m.out_features, dtype=x.dtype)
    result, failed = self_test_or_fall_back(loaded.model, loaded.config, torch.device("cpu"))
    assert result.ok and set(failed) == {"GGUFLinear"}
    layers = [m for m in loaded.model.modules() if isinstance(m, GGUFLinear)]
    assert layers and all(m.execution == "dequantized" and m.qweight is None for m in layers)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(_ids()), dense.model(_ids()), rtol=1e-5, atol=1e-5)
    described = gguf_execution(loaded.model_dir, loaded.dtype, "sm_80", None, loaded.model)
    assert described["execution"] == "dequantized at load to float32"
    assert "failed its self-test on this device" in described["reason"] and described["dequantized_layers"] > 0


@pytest.mark.skipif(INTERPRETED, reason="torch paths only: the interpreter child runs the kernels")
def test_an_experts_kernel_failing_its_self_test_falls_back_to_dequantized_experts(files):
    """Guards `GGUFExperts.fall_back` (workers/gguf/experts.py), called by `to_torch_path`: without it the
    experts keep their blocks; with it they hold gguf-py's dequantized weights and give the dense logits."""
    from workers.kernelize.selftest import self_test_or_fall_back

    loaded, dense = _load(files["qwen3moe"], "sm_80"), _load(files["qwen3moe"], "dense")
    apply_plan(loaded.model, KernelPlan("cpu", {"GGUFExperts": select("cuda", SM80)["GGUFExperts"]}))
    experts = [m for m in loaded.model.modules() if isinstance(m, GGUFExperts)]
    for m in experts:  # a kernel that computes nonsense on this device
        m.forward = lambda x, ids, weights: torch.ones_like(x)
    result, failed = self_test_or_fall_back(loaded.model, loaded.config, torch.device("cpu"))
    assert result.ok and set(failed) == {"GGUFExperts"}
    assert experts and all(m.execution == "dequantized" and m.gate_qweight is None for m in experts)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(_ids()), dense.model(_ids()), rtol=1e-5, atol=1e-5)
    described = gguf_execution(loaded.model_dir, loaded.dtype, "sm_80", None, loaded.model)
    assert described["dequantized_layers"] == len(experts) and "2 experts layers" not in described["execution"]


@pytest.mark.skipif(INTERPRETED, reason="torch paths only: the interpreter child runs the kernels")
@pytest.mark.parametrize("arch", ["qwen2", "qwen3moe"])
@pytest.mark.parametrize("token", ["sm_80", "sm_61", "cpu"])
def test_placement_counts_the_bytes_each_device_holds(files, token, arch):
    """Guards the GGUF lines of workers/contract/model_size.py `need_on`: the plan's weight bytes for a device
    are what its worker holds: the blocks where its rule keeps them packed, the dequantized size elsewhere."""
    from workers.contract.model_size import need_on, read_profile
    from workers.contract.topology import parse_simulate

    device = parse_simulate(token)[0]
    loaded = _load(files[arch], token)
    need = need_on(read_profile(loaded.model_dir), device, "float32")
    described = gguf_execution(loaded.model_dir, loaded.dtype, token, None, loaded.model)
    assert need.weight_bytes == described["resident_bytes"]
    assert need.gguf == ("dequantized" if token == "sm_61" else "packed")
    assert described["packed_layers"] > 0 if token != "sm_61" else described["packed_layers"] == 0


@pytest.mark.skipif(INTERPRETED, reason="torch paths only: the interpreter child runs the kernels")
@pytest.mark.parametrize("arch", ["qwen2", "qwen3moe"])
def test_the_cpu_kernel_layer_gives_the_dense_models_logits_for_a_prompt_and_decode_rows(files, arch):
    """Guards the CPU's kernel entry (kernels_local/mapping.py `GGUFLinearCpu`) and its GEMV: the packed
    model on the CPU, kernelized as its worker is, gives a CPU-without-the-kernel's logits within fp32
    rounding, for a prompt (dequantized per call) and for decode rows (the GEMV: 1..3 rows per call;
    MoE experts per active expert)."""
    from kernels_local.gguf_linear import cpu

    loaded, dense = _load(files[arch], "cpu"), _load(files[arch], "dense")
    chosen = select("cpu", None)
    choice = chosen["GGUFLinear"]
    assert choice.layer == "GGUFLinearCpu" and cpu.KERNEL.load().available
    assert chosen["GGUFExperts"].layer == "GGUFExpertsCpu"
    plan = {"GGUFLinear": choice, "GGUFExperts": chosen["GGUFExperts"]}
    assert apply_plan(loaded.model, KernelPlan("cpu", plan)) > (2 if arch == "qwen3moe" else 0)
    calls = []
    ops = cpu.KERNEL.module  # torch.ops.hetserve_cpu: shared by every copy of the repository's module
    linear = ops.gguf_linear
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "gguf_linear", lambda x, *a: calls.append(x.numel() // x.shape[-1]) or linear(x, *a))
        for ids in (_ids(3), _ids(3)[:1, :1], _ids(3)[:, :1]):  # 18 rows, one decode row, two
            torch.testing.assert_close(loaded.model(ids), dense.model(ids), rtol=1e-4, atol=1e-4)
    # the decode rows through the GEMV (1 and 2 rows a call) and the prompt's 18 through the panels
    assert {1, 2, 18} <= set(calls) and max(calls) == 18


@pytest.mark.skipif(INTERPRETED, reason="torch paths only: the interpreter child runs the kernels")
def test_deterministic_mode_tiles_the_rows_of_every_packed_projection(files):
    """Guards "GGUFLinear" in workers/model/deterministic.py `_is_projection`: without it a packed layer's
    rows are not tiled, and a row's result may depend on its batch mates under `--deterministic`."""
    from workers.model.deterministic import enable_deterministic

    loaded = _load(files["qwen3moe"], "sm_80")
    layers = [m for m in loaded.model.modules() if isinstance(m, GGUFLinear)]
    with torch.no_grad():
        want = loaded.model(_ids())
        enable_deterministic(loaded.model)
        assert all("forward" in m.__dict__ for m in layers)  # each wrapped in fixed row tiles
        torch.testing.assert_close(loaded.model(_ids()), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(INTERPRETED, reason="torch paths only: the interpreter child runs the kernels")
def test_the_cpu_keeps_a_tied_heads_blocks_once_for_the_head_and_the_embedding(files):
    """Guards workers/gguf/packed.py `_tied_candidate` (and `tied_head=device_type == "cpu"` in `packed_gguf`):
    on the CPU a Llama's tied head is a `GGUFLinear` holding `token_embd`'s blocks and the embedding a
    `GGUFEmbedding` reading the same tensor; its lookups equal the dequantized embedding bit for bit, the
    logits (eager and the compiled step's graph) the dense model's within fp32 rounding, and the
    description and placement count the blocks once."""
    from kernels_local.gguf_linear import cpu
    from workers.contract.model_size import need_on, read_profile
    from workers.contract.topology import parse_simulate
    from workers.gguf.embedding import GGUFEmbedding

    loaded, dense = _load(files["llama"], "cpu"), _load(files["llama"], "dense")
    head, embedding = loaded.model.output, loaded.model.tok_embeddings
    assert isinstance(head, GGUFLinear) and isinstance(embedding, GGUFEmbedding)
    assert head.qweight.data_ptr() == embedding.qweight.data_ptr() and head.gguf_type == embedding.gguf_type
    assert type(dense.model.output) is nn.Linear and dense.model.output.weight is dense.model.tok_embeddings.weight
    ids = _ids(4)
    assert torch.equal(embedding(ids), dense.model.tok_embeddings(ids))
    apply_plan(loaded.model, KernelPlan("cpu", {"GGUFLinear": select("cpu", None)["GGUFLinear"]}))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids), dense.model(ids), rtol=1e-4, atol=1e-4)
        compiled = torch.compile(embedding, fullgraph=True)  # the decoder's shape rule: no graph break
        assert torch.equal(compiled(ids[:, :1]), dense.model.tok_embeddings(ids[:, :1]))
    described = gguf_execution(loaded.model_dir, loaded.dtype, "cpu", None, loaded.model)
    assert f"keeps its {head.gguf_type} blocks" in described["reason"] and cpu.KERNEL.load().available
    need = need_on(read_profile(loaded.model_dir), parse_simulate("cpu")[0], "float32")
    assert need.weight_bytes == described["resident_bytes"]
    # off the CPU (a simulated sm_80) the tied head stays a dense nn.Linear tied to the embedding
    sim = _load(files["llama"], "sm_80").model
    assert type(sim.output) is nn.Linear and sim.output.weight is sim.tok_embeddings.weight
