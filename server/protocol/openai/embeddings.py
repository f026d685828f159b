"""`/v1/embeddings`: the request (pydantic, HTTP edge only), the pooling a checkpoint asks for,
and the answer in OpenAI's shape.

The pooling comes from the checkpoint, as sentence-transformers would load it: `modules.json`
naming a `Pooling` module (its `config.json`: `pooling_mode_lasttoken`, `_mean_tokens`,
`_cls_token`; other modes are a named error) and a `Normalize` module. A checkpoint without
that config (a plain decoder served with `--task embed`) gets last-token pooling, normalised:
what decoder embedding models such as Qwen3-Embedding are trained for. `dimensions` is
honoured only where the model says it is matryoshka-trained (config.json `is_matryoshka` or
`matryoshka_dimensions`, vLLM's keys), refused otherwise: a cut vector of another model means
nothing. Vectors go out as floats, or as base64 of little-endian float32 (`encoding_format`
base64, which the `openai` client asks for by default).
"""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from server.protocol.base import EdgeRequest

_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")

TokenIds = list[int]


class EmbeddingsRequest(EdgeRequest):
    model: str | None = Field(None, max_length=1000)
    input: str | list[str] | TokenIds | list[TokenIds] = Field()
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = Field(None, max_length=1000)

    def items(self) -> list[str | list[int]]:
        """The inputs as a list (a text, or one sequence of token ids, is one input)."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and all(isinstance(v, int) for v in value):
            return [list(value)]
        return list(value)


@dataclass(frozen=True)
class Pooling:
    """How a checkpoint's vectors are made, and why."""

    mode: str  # last | mean | cls
    normalize: bool
    matryoshka: bool
    reason: str


def pooling_of(model_dir: Path) -> Pooling:
    """The checkpoint's pooling (see the module docstring); `ValueError` for a mode not served."""
    config = _json(model_dir / "config.json") or {}
    matryoshka = bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))
    modules = _json(model_dir / "modules.json")
    if not isinstance(modules, list):
        return Pooling("last", True, matryoshka, "no sentence-transformers config: last token, normalised")
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    mode, reason = "last", "no Pooling module: last token"
    if "Pooling" in kinds:
        pooling = _json(model_dir / kinds["Pooling"].get("path", "") / "config.json") or {}
        other = [k for k in _OTHER_MODES if pooling.get(k)]
        if other:
            raise ValueError(f"The checkpoint's pooling `{other[0]}` is not served. Accepted: "
                             f"{', '.join(_MODES)}")
        mode = next((m for key, m in _MODES.items() if pooling.get(key)), "last")
        reason = f"sentence-transformers Pooling: {mode}"
    return Pooling(mode, "Normalize" in kinds, matryoshka, reason + (", normalised" if "Normalize" in kinds else ""))


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def encode_vector(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def embeddings_response(model: str, vectors: list[list[float]], tokens: list[int], encoding: str) -> dict:
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, encoding)}
            for i, v in enumerate(vectors)]
    used = sum(tokens)
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": used, "total_tokens": used}}
