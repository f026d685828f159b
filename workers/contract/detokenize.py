"""Incremental detokenization and stop strings, one small state object per sequence.

Design (the prefix/read-offset scheme of TGI and vLLM): each step decodes two short windows of
token ids, `ids[prefix:read]` (text already emitted) and `ids[prefix:]`, and emits the
difference; a window ending in U+FFFD (a UTF-8 character split across tokens) emits nothing
until the character is complete. The window is seeded with the prompt's last tokens, so a first
token's leading space decodes as in context. Special tokens never enter the window: their text is
flagged `special` (TGI), or joins the generated text with vLLM's `skip_special_tokens` false.
Stop strings match on the emitted text from the `stop_after`-th token on (vLLM's `min_tokens`);
the text is cut after the stop (TGI) or before it (OpenAI), and text that could begin a stop is
held back until it completes one or cannot. Trade-off: two small decodes per token instead of one
full decode, which keeps the cost per step flat however long the sequence grows."""

from __future__ import annotations

from collections.abc import Iterable

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens kept in the window so the first piece decodes in context
REPLACEMENT_CHAR = "\ufffd"


def special_token_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's special added tokens (`tokenizers.Tokenizer`)."""
    try:
        decoder = tokenizer.get_added_tokens_decoder()
    except AttributeError:
        return frozenset()
    return frozenset(i for i, tok in decoder.items() if getattr(tok, "special", False))


class IncrementalDetokenizer:
    """Text of one sequence's generated tokens, piece by piece."""

    __slots__ = ("_tok", "_ids", "_prefix", "_read", "_special", "_stops", "_max_stop", "_keep_stop", "_held",
                 "_skip_special", "_stop_after", "_count", "text", "stopped", "stop_hit")

    def __init__(self, tokenizer, prompt_ids: list[int], special_ids: frozenset[int], stop: Iterable[str] = (),
                 stop_in_text: bool = True, skip_special: bool = True, stop_after: int = 0):
        self._tok = tokenizer
        self._special = special_ids
        context = [t for t in prompt_ids[-PROMPT_CONTEXT_TOKENS:] if t not in special_ids]
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)
        self._stops = tuple(stop)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._keep_stop = stop_in_text
        self._held = ""  # text held back because it may start a stop string (stop not kept)
        self._skip_special = skip_special  # False: a special token's text is part of the text
        self._stop_after, self._count = stop_after, 0  # stop strings match from token `stop_after` on
        self.text = ""  # generated text emitted so far (after any stop-string cut)
        self.stopped = False  # a stop string was found
        self.stop_hit: str | None = None  # ... which one

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True) if ids else ""

    def add(self, token_id: int) -> tuple[str, bool]:
        """Feed one generated token; returns (its streamed text, is_special)."""
        if self.stopped:
            return "", token_id in self._special
        self._count += 1
        if token_id in self._special:
            if self._skip_special:
                return self._tok.id_to_token(token_id) or "", True
            return self._append(self._tok.id_to_token(token_id) or ""), False
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        # 1. Hold back an incomplete UTF-8 character (decodes as U+FFFD) until it completes.
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return "", False
        # 2. Emit the new text and slide the window.
        piece = full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        return self._append(piece), False

    def flush(self) -> str:
        """Text still held back when the sequence ends (even an incomplete character)."""
        if self.stopped:
            return ""
        piece = ""
        if self._read != len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix : self._read])
            piece = self._decode(self._ids[self._prefix :])[len(prefix_text) :]
            self._prefix = self._read = len(self._ids)
        out = self._append(piece)
        if not self.stopped and self._held:  # no stop completed: what was held is text after all
            out, self.text, self._held = out + self._held, self.text + self._held, ""
        return out

    def _append(self, piece: str) -> str:
        """Add `piece` to the text; cut it after (or before) the first stop string it completes."""
        if self._count < self._stop_after:  # `min_tokens` not reached: no stop string yet
            self.text += piece
            return piece
        if not self._keep_stop:
            return self._append_without_stop(piece)
        if not self._stops or not piece:
            self.text += piece
            return piece
        start = max(0, len(self.text) - self._max_stop + 1)  # a stop may straddle the old text
        text = self.text + piece
        ends = [text.find(s, start) for s in self._stops]
        hits = [pos + len(s) for pos, s in zip(ends, self._stops, strict=True) if pos >= 0]
        if not hits:
            self.text = text
            return piece
        cut = min(hits)
        self.stopped = True
        self.stop_hit = next(st for pos, st in zip(ends, self._stops, strict=True) if pos >= 0 and pos + len(st) == cut)
        kept = text[len(self.text) : cut]
        self.text = text[:cut]
        return kept

    def _append_without_stop(self, piece: str) -> str:
        """Emit what cannot be part of a stop string; cut before a completed one."""
        buf = self._held + piece
        hits = [(pos, s) for s in self._stops if (pos := buf.find(s)) >= 0]
        if hits:
            cut = min(pos for pos, _ in hits)
            self.stopped, self._held = True, ""
            self.stop_hit = next(st for pos, st in hits if pos == cut)
            self.text += buf[:cut]
            return buf[:cut]
        # Hold back the longest tail of `buf` that begins some stop string.
        keep = next((n for n in range(min(len(buf), self._max_stop - 1), 0, -1)
                     if any(s.startswith(buf[-n:]) for s in self._stops)), 0)
        out, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self.text += out
        return out


class NoText:
    """The engine's stand-in for `IncrementalDetokenizer` when the router builds the text (its
    stream channel carries token ids): no decoding and no stop strings on the engine's thread."""

    __slots__ = ("_special",)
    text, stopped, stop_hit = "", False, None

    def __init__(self, special_ids: frozenset[int]):
        self._special = special_ids

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def add(self, token_id: int) -> tuple[str, bool]:
        return "", token_id in self._special

    def flush(self) -> str:
        return ""


class TokenBytes:
    """Each token's own bytes (not its streamed piece), for logprob entries; cached per id.
    A special token's bytes are its content (`<|eos|>`). `decode_bytes(ids)`: the tokenizer's
    raw bytes of `ids` (llguidance's `LLTokenizer.decode_bytes`)."""

    def __init__(self, decode_bytes, special_ids: frozenset[int] = frozenset()):
        self._decode = decode_bytes
        self.special_ids = special_ids
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        b = self._cache.get(token_id)
        if b is None:
            b = self._cache[token_id] = bytes(self._decode([token_id]))
        return b

    def text(self, token_id: int) -> str:
        return self(token_id).decode("utf-8", errors="replace")
