"""LoRA beside the compiled decode step: adapters hooked into a model whose decode step is already
compiled leave its base rows as they were, and steps holding adapter rows run eager with PEFT's
tokens (workers/engine/runner.py skips the compiled step for them)."""

from __future__ import annotations

import pytest
import torch

from tests.family_checkpoints import make_family_checkpoint
from tests.lora_adapters import make_adapter, peft_model
from tests.test_compiled_step import make_engine
from workers.contract import WorkerConfig
from workers.lora.worker import install_loras
from workers.model.loader import load_model
from workers.sampling.params import SamplingParams

pytest.importorskip("peft")
NEW_TOKENS = 10


def _run(engine, jobs) -> list[list[int]]:
    streams = [engine.submit(p, SamplingParams.create(max_new_tokens=NEW_TOKENS), lora=lora) for p, lora in jobs]
    while engine.step():
        pass
    return [[e.token_id for e in s.events] for s in streams]


def test_adapters_hooked_after_compiling_leave_the_base_rows_and_run_eager(tmp_path):
    torch.set_num_threads(1)
    base = make_family_checkpoint("llama", tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "coder", 1)
    lm = load_model(base, "float32")
    engine = make_engine(lm, "inductor")
    prompt = lm.tokenizer.encode("Once upon a time there was a little fox who lived near the river").ids
    before = _run(engine, [(prompt, None), (prompt[2:], None)])
    config = WorkerConfig(socket="/tmp/unused.sock", lora=f"coder={adapter}")
    install_loras(engine, config, lm, "cpu")  # hooks go on after the decode step compiled
    compiled_runs = []
    run = engine.runner.compiled.run
    engine.runner.compiled.run = lambda chunks: (compiled_runs.append([c.seq.lora for c in chunks]), run(chunks))[1]
    after = _run(engine, [(prompt, None), (prompt, "coder"), (prompt[2:], None)])
    assert [after[0], after[2]] == before
    with torch.no_grad():
        ref = peft_model(base, adapter)
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                           eos_token_id=ref.generation_config.eos_token_id)
    assert after[1] == out[0, len(prompt):].tolist() != before[0]
    assert all(lora is None for step in compiled_runs for lora in step), "an adapter row ran on the compiled step"
    assert _run(engine, [(prompt, None)]) == before[:1] and compiled_runs[-1] == [None]  # base alone: compiled again
