"""Embeddings without a server: the pooling a checkpoint's sentence-transformers config names
(server/protocol/openai/embeddings.py `pooling_of`), the request's inputs, base64 vectors, and
the worker's pooling of hidden states (workers/engine/pooling.py `pool`)."""

from __future__ import annotations

import base64
import json
import struct

import pytest
import torch

from server.protocol.openai.embeddings import EmbeddingsRequest, embeddings_response, pooling_of
from workers.engine.pooling import pool


def _st(tmp_path, mode: str | None, normalize: bool, **config):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8, **config}))
    if mode is None:
        return tmp_path
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({mode: True}))
    return tmp_path


@pytest.mark.parametrize(("mode", "normalize", "want"), [
    (None, True, ("last", True)),  # a plain decoder: its last token, normalised
    ("pooling_mode_lasttoken", True, ("last", True)),
    ("pooling_mode_mean_tokens", False, ("mean", False)),
    ("pooling_mode_cls_token", True, ("cls", True)),
])
def test_the_pooling_is_the_checkpoints_own(tmp_path, mode, normalize, want):
    p = pooling_of(_st(tmp_path, mode, normalize))
    assert (p.mode, p.normalize, p.matryoshka) == (*want, False) and p.reason


def test_a_pooling_mode_not_served_is_named_and_matryoshka_is_read_from_the_config(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    with pytest.raises(ValueError, match="`pooling_mode_max_tokens`.*Accepted: pooling_mode_lasttoken"):
        pooling_of(_st(tmp_path / "a", "pooling_mode_max_tokens", True))
    assert pooling_of(_st(tmp_path / "b", None, True, is_matryoshka=True)).matryoshka
    assert pooling_of(_st(tmp_path / "c", None, True, matryoshka_dimensions=[32, 64])).matryoshka


@pytest.mark.parametrize(("given", "items"), [
    ("a text", ["a text"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_every_input_shape_is_a_list_of_inputs(given, items):
    assert EmbeddingsRequest.model_validate({"input": given}).items() == items


def test_base64_vectors_are_little_endian_float32():
    vector = [0.5, -1.25, 3.0]
    body = embeddings_response("m", [vector], [4], "base64")
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert list(struct.unpack("<3f", raw)) == vector
    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 4} and body["data"][0]["index"] == 0


def test_pooling_of_hidden_states():
    states = torch.tensor([[3.0, 4.0, 0.0], [1.0, 0.0, 0.0], [0.0, 2.0, 2.0]])  # [S, H]
    assert pool(states, "last", None, False) == [0.0, 2.0, 2.0]
    assert pool(states, "cls", None, True) == pytest.approx([0.6, 0.8, 0.0])
    assert pool(states, "mean", None, False) == pytest.approx([4 / 3, 2.0, 2 / 3])
    assert pool(states, "cls", 1, True) == pytest.approx([1.0])  # cut to 1, then normalised again
    with pytest.raises(ValueError, match="`max`.*Accepted: last, mean, cls"):
        pool(states, "max", None, True)
