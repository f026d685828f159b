"""Gated DeltaNet (workers/model/linear_attention.py): its two forms agree, a prompt computed in
chunks over several steps (and beside other sequences) equals one whole forward because the
state slot carries it, and a migrated stream rebuilds the state from prompt plus resumed tokens."""

from __future__ import annotations

import types

import pytest
import torch

from tests.family_checkpoints import make_family_checkpoint
from workers.engine.core import Engine
from workers.engine.runner import ModelRunner
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.kv.batch import ForwardBatch, SeqChunk
from workers.kv.state import StatePool
from workers.model.config import ModelConfig
from workers.model.linear_attention import GatedDeltaNet, chunked_delta_rule, recurrent_delta_rule
from workers.model.loader import load_model
from workers.sampling.params import SamplingParams

CONFIG = ModelConfig(architecture="qwen3_5", hidden_size=48, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, norm_style="gemma", qk_norm="head", attn_output_gate=True,
                     layer_types=("linear_attention", "full_attention"), linear_num_key_heads=2,
                     linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel=4)


def _rule_inputs(b: int, s: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, s, 2, 16, generator=gen) for _ in range(2))  # [B, S, Hk, Dk]
    v = torch.randn(b, s, 4, 8, generator=gen)  # [B, S, Hv, Dv]
    g = -torch.rand(b, s, 4, generator=gen) * 0.5  # log decays <= 0
    beta = torch.rand(b, s, 4, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_and_recurrent_forms_agree_across_chunks_from_a_given_state(chunk):
    q, k, v, g, beta = _rule_inputs(2, 150)  # 150 tokens: several chunks and a padded last one
    state = torch.randn(2, 4, 16, 8, generator=torch.Generator().manual_seed(1))
    want, want_state = recurrent_delta_rule(q, k, v, g, beta, state)
    got, got_state = chunked_delta_rule(q, k, v, g, beta, state, chunk)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state, atol=2e-5, rtol=1e-5)
    # split in two at any point, the state carried between: the same as one call
    head, mid = chunked_delta_rule(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37], state, chunk)
    tail, end = chunked_delta_rule(q[:, 37:], k[:, 37:], v[:, 37:], g[:, 37:], beta[:, 37:], mid, chunk)
    torch.testing.assert_close(torch.cat((head, tail), 1), want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(end, want_state, atol=2e-5, rtol=1e-5)


def _layer(seed: int = 0) -> GatedDeltaNet:
    torch.manual_seed(seed)
    layer = GatedDeltaNet(CONFIG, 0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer.eval()


@pytest.mark.parametrize("token_by_token", [False, True], ids=["chunked", "deterministic"])
def test_steps_over_chunks_of_two_sequences_equal_one_whole_forward(token_by_token):
    """Two sequences (slots 2 and 0 of a pool of 3) computed over six steps in chunks of every kind:
    a one-token first chunk (a fresh decode row), prompt chunks, decode rows, and steps mixing
    them; each sequence's outputs equal its own full forward, so the conv and recurrent states
    carried in its slot are exactly what one pass builds, and the other sequence never touches them."""
    layer = _layer()
    layer.rule.token_by_token = token_by_token
    x = torch.randn(2, 30, CONFIG.hidden_size, generator=torch.Generator().manual_seed(2))  # [2, S, H]
    with torch.no_grad():
        want = layer(x)  # [2, S, H]
    states = StatePool.for_config(CONFIG, 3, torch.float32)
    states.conv.fill_(7.0)  # stale values of earlier sequences: a fresh sequence must not read them
    states.recurrent.fill_(-3.0)
    kv = types.SimpleNamespace(states=states)
    plan = [[(0, 1), (0, 5)], [(1, 9), (5, 1)], [(10, 1), (6, 14)], [(11, 12), (20, 1)], [(23, 7), (21, 9)]]
    slots, got = (2, 0), torch.empty_like(want)
    with torch.no_grad():
        for step in plan:
            chunks = [(SeqChunk(start, n, [0] * 8, state_slot=slots[i]), [0] * n) for i, (start, n) in enumerate(step)]
            batch = ForwardBatch.build(chunks, 4)
            rows = torch.cat([x[i, start : start + n] for i, (start, n) in enumerate(step)])  # [T, H] packed
            out = layer.step(rows, types.SimpleNamespace(batch=batch, kv=kv))
            row = 0
            for i, (start, n) in enumerate(step):
                got[i, start : start + n] = out[row : row + n]
                row += n
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert torch.equal(states.recurrent[0, 1], torch.full_like(states.recurrent[0, 1], -3.0))  # slot 1 untouched


def test_a_migrated_stream_rebuilds_the_state_from_prompt_and_resumed_tokens(tmp_path):
    """A Qwen3.5 request resumed on a fresh engine after `cut` tokens (the router's stream
    migration) continues with exactly the tokens the original generated: its prefill over
    prompt + resumed tokens rebuilds every linear layer's state (workers/engine/resume.py)."""
    ours = load_model(make_family_checkpoint("qwen3_5", tmp_path), "float32")
    prompt = ours.tokenizer.encode("Once upon a time there was a little fox who lived near the river").ids

    def run(resume=()):
        pool = ours.model.new_kv_pool(64, 4, state_slots=2)
        config = SchedulerConfig(2, 512, 64, 4, 16, False, eos_token_ids=(), state_slots=pool.states.num_slots)
        engine = Engine(ModelRunner(ours.model, pool, "cpu"), Scheduler(config), ours.tokenizer, max_queue=4)
        stream = engine.submit(prompt, SamplingParams.create(max_new_tokens=20), resume_ids=resume)
        while engine.step():
            pass
        return [e.token_id for e in stream.events]

    original = run()
    for cut in (1, 9):
        assert run(original[:cut]) == original[cut:], cut


HYBRIDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


@pytest.mark.parametrize("case", HYBRIDS)
def test_prompts_of_several_rule_chunks_batched_and_split_over_steps_match_transformers(case, tmp_path):
    """Prompts of 150 and 97 tokens (over two of the rule's 64-token chunks, the last one padded)
    beside a short one: the full forward's fp32 logits within 1e-4 of transformers', and 32 greedy
    tokens identical to transformers' `generate` for each prompt alone, through the engine with
    all three batched and the prefills split into 40-token steps (chunk ends that fall inside
    a rule chunk, carried by the state slots), with a pool so small that sequences are preempted
    and recomputed from a fresh state. Guards `chunked_delta_rule`'s loop across chunks and
    `GatedDeltaNet._convolve`'s window across steps."""
    import transformers

    torch.set_num_threads(1)
    path = make_family_checkpoint(case, tmp_path / case)
    ours = load_model(path, "float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 4096, (n,), generator=gen).tolist() for n in (150, 97, 9)]
    with torch.no_grad():
        ids = torch.tensor([prompts[0], prompts[1] + prompts[0][:53]])  # [2, 150]
        torch.testing.assert_close(ours.model(ids).float(), ref(ids).logits, atol=1e-4, rtol=0)
        want = [ref.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(p):].tolist() for p in prompts]  # fmt: skip
    for blocks, expect_preemption in ((128, False), (48, True)):
        pool = ours.model.new_kv_pool(blocks, 4, state_slots=3)
        config = SchedulerConfig(3, 512, blocks, 4, 40, True, eos_token_ids=(), state_slots=pool.states.num_slots)
        engine = Engine(ModelRunner(ours.model, pool, "cpu"), Scheduler(config), ours.tokenizer, max_queue=4)
        streams = [engine.submit(p, SamplingParams.create(max_new_tokens=32)) for p in prompts]
        while engine.step():
            pass
        assert [[e.token_id for e in s.events] for s in streams] == want, (case, blocks)
        assert (engine.scheduler.num_preemptions > 0) == expect_preemption, engine.scheduler.num_preemptions
        assert engine.scheduler.kv.states.num_free == 3 and not engine.scheduler.config.prefix_caching


def test_plan_shows_the_linear_layers_their_kernel_and_state(tmp_path, capsys):
    """`hetserve plan --model DIR` on Qwen3-Next: the DeltaNet layers apart from the KV-holding
    full layer, with the device's GatedDeltaRule kernel and the state each sequence keeps.
    Guards `linear_layers` in workers/model/describe.py and its row in server/commands/plan_model.py."""
    import json

    from server.cli import main
    from server.commands.plan_model import render_attention

    path = make_family_checkpoint("qwen3_next", tmp_path / "next")
    assert main(["plan", "--simulate", "sm_80,sm_90", "--model", str(path), "--json"]) == 0
    ampere, hopper = json.loads(capsys.readouterr().out)["devices"]
    for entry, kernel in ((ampere, "GatedDeltaRuleTritonSm70"), (hopper, "GatedDeltaRuleTritonSm90")):
        linear = entry["linear_attention"]
        assert linear["layers"] == [0, 1, 2] and linear["kernel"]["kernel"] == f"kernels_local/gated_delta:{kernel}"
        assert [row["layers"] for row in entry["attention"]] == [[3]]  # only the full layer keeps KV
        assert "unused" not in entry["kernels"]["GatedDeltaRule"]
    lines = render_attention(hopper)
    assert "  linear attention (gated_deltanet): layers [0, 1, 2], 2 key heads of 16, 4 value heads of 16" in lines
    assert any("recurrent [4, 16, 16] fp32" in line for line in lines), lines


def test_deterministic_mode_gives_the_same_numbers_however_the_prompt_is_chunked(tmp_path):
    """`--deterministic` (workers/model/deterministic.py `enable_deterministic`) turns every
    DeltaNet's `token_by_token` on, so a prompt prefilled in 7-token steps and in one step give
    bit-identical logprobs: the chunked form's sums would depend on where the steps cut it; and
    turns `tail_free` on, so its gates, convolution and gated norm give a token the same bits in a
    7-token step as in a 90-token one (on some CPUs libm's exp in ATen's scalar tail rounds otherwise
    than its vector code). Guards the `token_by_token` and `tail_free` lines of `enable_deterministic`."""
    from workers.model.deterministic import enable_deterministic

    ours = load_model(make_family_checkpoint("qwen3_5", tmp_path), "float32")
    enable_deterministic(ours.model)
    rules = [m for m in ours.model.modules() if hasattr(m, "token_by_token")]
    assert len(rules) == 3 and all(m.token_by_token for m in rules)
    prompt = torch.randint(3, 4096, (90,), generator=torch.Generator().manual_seed(4)).tolist()

    def run(budget: int) -> list[float]:
        pool = ours.model.new_kv_pool(64, 4, state_slots=1)
        config = SchedulerConfig(1, 512, 64, 4, budget, False, eos_token_ids=(), state_slots=1)
        engine = Engine(ModelRunner(ours.model, pool, "cpu", mirror=False), Scheduler(config), ours.tokenizer,
                        max_queue=2)  # fmt: skip
        stream = engine.submit(prompt, SamplingParams.create(max_new_tokens=6))
        while engine.step():
            pass
        return [(e.token_id, e.logprob) for e in stream.events]

    assert run(7) == run(128)
