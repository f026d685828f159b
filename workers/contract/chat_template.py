"""Where a model directory keeps its chat template: one lookup, one precedence.

Order, as `transformers` resolves it when it loads a tokenizer: `chat_template.jinja` in the
model directory first (the newer, separate file overrides the config), then
`tokenizer_config.json["chat_template"]`, which is either a string or a list of named
templates (`[{"name": "default", "template": ...}, {"name": "tool_use", ...}]`) of which
`default` is used, else the first. The worker reports what it found in `/capability`; the
router renders chat prompts with the same template (`server.protocol.chat`). Reading files only: no
tokenizer, no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

JINJA_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class FoundTemplate:
    source: str
    origin: str  # the file it came from (shown in logs)


def read_tokenizer_config(model_dir: Path | str | None) -> dict:
    """`tokenizer_config.json` as a dict; {} when absent or not valid JSON."""
    if model_dir is None:
        return {}
    try:
        value = json.loads((Path(model_dir) / TOKENIZER_CONFIG).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def read_special_tokens(model_dir: Path | str | None) -> tuple[str, ...]:
    """The text of every special token the tokenizer parses out of a prompt (`<|im_start|>`,
    `</s>`): `tokenizer.json`'s special added tokens and `tokenizer_config.json`'s
    `added_tokens_decoder`; () when neither file says."""
    if model_dir is None:
        return ()
    found: set[str] = set()
    try:
        tokenizer = json.loads((Path(model_dir) / TOKENIZER_FILE).read_text())
    except (OSError, ValueError):
        tokenizer = {}
    entries = list(tokenizer.get("added_tokens") or []) if isinstance(tokenizer, dict) else []
    decoder = read_tokenizer_config(model_dir).get("added_tokens_decoder") or {}
    entries += list(decoder.values()) if isinstance(decoder, dict) else []
    for entry in entries:
        if (isinstance(entry, dict) and entry.get("special") and isinstance(entry.get("content"), str)
                and entry["content"]):
            found.add(entry["content"])
    return tuple(sorted(found, key=lambda t: (-len(t), t)))


def token_text(value) -> str | None:
    """`"<s>"` or an AddedToken dict `{"content": "<s>", ...}` -> `"<s>"`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _from_config(raw) -> str | None:
    if isinstance(raw, str):
        return raw or None
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        chosen = named.get("default") or next((t for t in named.values() if isinstance(t, str)), None)
        return chosen if isinstance(chosen, str) else None
    return None


def find_chat_template(model_dir: Path | str | None, tokenizer_config: dict | None = None) -> FoundTemplate | None:
    """The model directory's chat template in the order above; None when it has none."""
    if model_dir is None:
        return None
    jinja = Path(model_dir) / JINJA_FILE
    if jinja.is_file():
        return FoundTemplate(jinja.read_text(), str(jinja))
    config = read_tokenizer_config(model_dir) if tokenizer_config is None else tokenizer_config
    source = _from_config(config.get("chat_template"))
    return None if source is None else FoundTemplate(source, str(Path(model_dir) / TOKENIZER_CONFIG))
