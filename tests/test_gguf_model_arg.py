"""`--model` with a GGUF file, a named GGUF file or a directory of GGUF files (server/config/models.py):
the router serves each from its prepared directory, named by the file unless named."""

from __future__ import annotations

import json

import pytest

from server.config.models import parse_model_arg
from server.errors import UsageError
from tests.gguf_checkpoints import cached_gguf

pytest.importorskip("gguf")
pytest.importorskip("transformers")


def test_a_gguf_file_its_name_and_its_directory():
    path = cached_gguf("qwen2", "Q8_0")
    bare, named, folder = parse_model_arg(str(path)), parse_model_arg(f"chat={path}"), parse_model_arg(str(path.parent))
    assert (bare.name, named.name, folder.name) == ("qwen2-Q8_0", "chat", path.parent.name)
    assert bare.path == named.path == folder.path  # one prepared directory, made once
    assert json.loads((bare.path / "gguf.json").read_text())["files"] == [str(path)]
    assert json.loads((bare.path / "config.json").read_text())["model_type"] == "qwen2"


def test_a_broken_gguf_file_is_one_usage_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 8)
    with pytest.raises(UsageError, match=r"^`--model [^`]+`: `\S+broken.gguf` cannot be read as GGUF"):
        parse_model_arg(str(bad))
