"""Output text in, content and incremental tool calls out, for every format in `syntax.py`.

Design: `ToolCallSplitter` is fed the answer piece by piece (a stream, token by token; a whole
answer, all at once) and gives out the same `Part`s as harmony's splitter (content, a call's
start with its name, its argument text), so one consumer serves both. A piece costs time in
proportion to its own length, not to the answer's so far (the router reads every stream on its
event loop): text outside a region is read once, and a region is re-read through its
`RegionMemo`, which resumes where the last reading stopped. Trade-off: a stream cannot
take back what it has sent, so a call begun and then broken (cut by the length limit, malformed
JSON after the name) stays a call there, with the arguments it had; a whole answer is stricter
(`split_tool_calls`): its calls count only if every one is complete and its arguments parse as a
JSON object, otherwise the whole answer is content, never an error.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.protocol.harmony import ARGUMENTS, CONTENT, TOOL_CALL, Part, gather
from server.protocol.tool_parsers.region import RegionMemo, RegionScan, json_object, parse_region
from server.protocol.tool_parsers.syntax import ToolSyntax


@dataclass(frozen=True)
class ToolAnswer:
    """A whole answer: its content (None when empty) and its calls as (name, arguments JSON)."""

    content: str | None
    calls: tuple[tuple[str, str], ...]


def _partial_tail(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins some marker (what may still become one)."""
    best = 0
    for m in markers:
        for k in range(min(len(text), len(m) - 1), best, -1):
            if m.startswith(text[-k:]):
                best = k
                break
    return best


class ToolCallSplitter:
    """Content and incremental calls from an answer fed piece by piece; `names` are the
    request's tools (a call of another is text).

    Outside a call region it reads each piece once and holds back only what may still become an
    opening marker (`<tool` at the end of a piece), or, for formats whose call may be the bare
    answer, whitespace at the start of the answer. Inside a region it re-reads the region
    (`region.py`, resuming through the region's memo) and sends what grew: a call as soon as
    its name is known, then its arguments as they are written, as vLLM streams them. Whitespace
    between content and a call is dropped."""

    def __init__(self, syntax: ToolSyntax, names: tuple[str, ...]):
        self.syntax, self.names = syntax, names
        self._openings = tuple(m for m, _ in syntax.openings)
        self._held = ""  # text outside a region not given out yet
        self._started = False  # the answer has begun (a bare `{` opens a region only at its start)
        self._region: tuple[str, str | None, str] | None = None  # (marker, closer, text) of the open region
        self._memo = RegionMemo()  # the open region's earlier readings
        self._sent: list[int] = []  # per call of the open region: argument characters sent
        self._first = 0  # the open region's first call's number
        self._space = ""  # whitespace held: dropped next to a call, else sent with what follows
        self._after_call = False  # content right after a region loses its leading whitespace
        self.calls = 0  # calls begun
        self.valid = True  # every call closed, arguments a JSON object (a whole answer may keep them)

    def feed(self, piece: str) -> list[Part]:
        """The parts that `piece` lets out (possibly none)."""
        out: list[Part] = []
        if self._region is not None:
            marker, closer, text = self._region
            self._region = None  # the text's only reference is then `text`: it grows in place, not copied
            text += piece
            self._region = (marker, closer, text)
        elif self.syntax.bare and not self._started and not piece.strip():
            self._held += piece  # whitespace before the answer: nothing to read yet
            return out
        else:
            self._held += piece
        self._advance(False, out)
        return out

    def finish(self) -> list[Part]:
        """What was held back, at the end of the answer."""
        out: list[Part] = []
        self._advance(True, out)
        if self._space and not self.calls:
            out.append(Part(CONTENT, self._space))
        self._space = ""
        return out

    # -- outside a region -----------------------------------------------------------------
    def _advance(self, final: bool, out: list[Part]) -> None:
        while True:
            if self._region is not None and not self._in_region(final, out):
                return
            held = self._held
            if not held:
                return
            if self.syntax.bare and not self._started:
                body = held.lstrip()
                if not body:
                    if final:
                        self._content(held, out)
                        self._held = ""
                    return
                self._started = True
                if body[0] in "{[":  # the leading whitespace stands as the marker (text, if no call)
                    self._enter(held[: len(held) - len(body)], None, body)
                    continue
            at, marker, closer = self._earliest(held)
            if marker is not None:
                self._content(held[:at], out)
                self._enter(marker, closer, held[at + len(marker):])
                continue
            keep = 0 if final else _partial_tail(held, self._openings)
            self._content(held[: len(held) - keep], out)
            self._held = held[len(held) - keep:]
            return

    def _earliest(self, text: str) -> tuple[int, str | None, str | None]:
        found = [(at, m, c) for m, c in self.syntax.openings if (at := text.find(m)) >= 0]
        return min(found, key=lambda f: f[0]) if found else (-1, None, None)

    def _enter(self, marker: str, closer: str | None, text: str) -> None:
        self._region, self._held, self._started = (marker, closer, text), "", True
        self._sent, self._first, self._space, self._memo = [], self.calls, "", RegionMemo()

    def _content(self, text: str, out: list[Part]) -> None:
        if not text:
            return
        self._started = self._started or bool(text.strip())
        text = self._space + text
        if self._after_call:
            text = text.lstrip()
        body = text.rstrip()
        self._space = text[len(body):]
        if body:
            self._after_call = False
            out.append(Part(CONTENT, body))

    # -- inside a region ------------------------------------------------------------------
    def _in_region(self, final: bool, out: list[Part]) -> bool:
        """Read the open region; True when it has closed (the text after it is held again)."""
        marker, closer, text = self._region
        scan = parse_region(text, self.syntax, self.names, closer, final, self._memo)
        self._send(scan, out)
        self._memo.release()
        if scan.failed:
            if not self._sent:  # nothing of it went out: it was text after all
                self._region = None
                self._content(marker, out)  # the marker is text; what follows is read again
                self._held = text
                return True
            self.valid = False
            self._leave(text[scan.fail_at:])
            return True
        if scan.end is not None:
            self.valid = self.valid and all(c.complete and json_object(c.arguments) for c in scan.calls)
            self._leave(text[scan.end:])
            return True
        if final:
            if not self._sent:
                self._region = None
                self._content(marker + text, out)
                return True
            self.valid = False
            self._leave("")
            return True
        return False

    def _send(self, scan: RegionScan, out: list[Part]) -> None:
        """Parts for what grew: calls before the last one sent were complete when sent."""
        start = max(len(self._sent) - 1, 0)
        for k, call in enumerate(scan.calls[start:], start):
            number = self._first + k
            if k == len(self._sent):
                out.append(Part(TOOL_CALL, call.name, number))
                self._sent.append(0)
                self.calls += 1
            grown = call.arguments_from(self._sent[k])
            if grown:
                out.append(Part(ARGUMENTS, grown, number))
                self._sent[k] += len(grown)

    def _leave(self, rest: str) -> None:
        self._region, self._held = None, rest
        self._after_call, self._space = True, ""


def split_tool_calls(syntax: ToolSyntax, names: tuple[str, ...], text: str) -> ToolAnswer:
    """A whole answer's content and calls; an answer whose calls do not all parse is content."""
    splitter = ToolCallSplitter(syntax, names)
    answer = gather(splitter.feed(text) + splitter.finish())
    if answer.calls and (not splitter.valid or not all(json_object(a) for _, a in answer.calls)):
        return ToolAnswer(text or None, ())
    return ToolAnswer(answer.content, answer.calls)
