"""Speculative decoding over LoRA adapters: a drafted row runs with its own adapter (the prompt-chunk
path carries each chunk's adapter), so a batch mixing adapters and the base gives plain decoding's
greedy tokens with drafts verified."""

from __future__ import annotations

import pytest

from tests.test_lora_parity import _engine, _ids, _run, served  # noqa: F401 (the fixture)
from workers.engine.speculate import Speculator
from workers.spec.policy import SpecPolicy

pytest.importorskip("peft")


def test_drafted_rows_keep_their_adapters(served):  # noqa: F811
    _, _, ours, table = served
    ids = _ids(ours)[0].tolist()
    prompt = ids + ids + ids[:10]  # repeated text: n-gram drafts from the prompt
    jobs = [(prompt, "all"), (prompt, None), (prompt, "rs")]
    plain = _run(_engine(ours, table), jobs)
    engine = _engine(ours, table)
    engine.speculator = Speculator("ngram", SpecPolicy(4, 8))
    assert _run(engine, jobs) == plain
    assert engine.speculator.draft_tokens > 0
    assert all(info.running == 0 for info in table.describe())
