"""A sandboxed grammar compiler: a child of the worker that builds one grammar at a time,
under a memory cap, and says whether it fits.

Run as `python -m workers.sampling.grammar_child` by workers/sampling/grammar_sandbox.py, over
length-prefixed JSON frames on stdin and stdout: first the tokenizer (`tokenizer`, `vocab_size`,
`eos`), then grammars (`kind`, `text`, `strict`, `memory_bytes`), each answered with
`{"ok": true, "bytes", "dead"}` or `{"ok": false, "error"}` / `{"ok": false, "budget": "memory"}`.
Design: before each build the child caps its data segment (RLIMIT_DATA) at what it holds plus the
budget, so an allocation beyond it aborts this process, never the worker; a matcher's bytes are
glibc's allocated bytes (`mallinfo2`) after the build minus before, and `malloc_trim` gives them
back afterwards. It dies with the thread that started it (PR_SET_PDEATHSIG) and at the end of its
stdin, and imports only llguidance and the standard library (no torch), so it starts quickly.
Trade-off: a grammar is built here and then again in the worker, the price of a build that can
be killed."""

from __future__ import annotations

import ctypes
import json
import resource
import signal
import struct
import sys

import llguidance

from workers.sampling.grammar_source import LIMITS, GrammarError, describe, engine_reason, grammar_source

_LEN = struct.Struct(">I")
_PR_SET_PDEATHSIG = 1


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):  # not glibc: no byte count, no trim
        return None


_LIBC = _libc()


def allocated_bytes() -> int:
    if _LIBC is None:
        return 0
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


def data_bytes() -> int:
    """This process's data segment now (VmData), what RLIMIT_DATA counts."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def read_frame(stream) -> dict | None:
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    body = stream.read(_LEN.unpack(head)[0])
    return json.loads(body)


def write_frame(stream, value: dict) -> None:
    body = json.dumps(value).encode()
    stream.write(_LEN.pack(len(body)) + body)
    stream.flush()


def build(tokenizer: llguidance.LLTokenizer, eos: tuple[int, ...], request: dict) -> dict:
    """One grammar built under the request's memory budget (see the module docstring)."""
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = data_bytes() + int(request["memory_bytes"])
    resource.setrlimit(resource.RLIMIT_DATA, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        source = grammar_source(request["kind"], request["text"], bool(request.get("strict", True)))
        before = allocated_bytes()
        matcher = llguidance.LLMatcher(tokenizer, source, log_level=0, limits=LIMITS)
        held = max(0, allocated_bytes() - before)
        if matcher.is_error():
            return {"ok": False, "error": _refused(request["kind"], matcher.get_error())}
        mask = matcher.compute_bitmask()
        if matcher.is_error():  # the first mask itself fails (a `$ref` cycle: no token can start)
            return {"ok": False, "error": f"The {describe(request['kind'])} allows no output: no token can start it "
                                          f"(the engine says `{engine_reason(matcher.get_error())}`). Accepted: a "
                                          "grammar whose output ordinary tokens can write"}
        dead = not matcher.is_accepting() and not allows_output(mask, eos)
        del matcher
        return {"ok": True, "bytes": held, "dead": dead}
    except MemoryError:
        return {"ok": False, "budget": "memory"}
    except GrammarError as e:
        return {"ok": False, "error": str(e)}
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))
        if _LIBC is not None:
            _LIBC.malloc_trim(0)


def _refused(kind: str, reason: str) -> str:
    return f"The {describe(kind)} cannot be enforced: {engine_reason(reason)}"


def allows_output(mask: bytes, eos: tuple[int, ...]) -> bool:
    """Does a bitmask (bit t % 8 of byte t // 8 for token t) allow a token other than EOS?"""
    bits = bytearray(mask)
    for t in eos:
        if t // 8 < len(bits):
            bits[t // 8] &= 0xFF ^ (1 << (t % 8))
    return bits.count(0) != len(bits)


def main() -> int:
    if _LIBC is not None:  # die with the thread that started this child
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    header = read_frame(stdin)
    if header is None:
        return 0
    eos = tuple(header["eos"])
    tokenizer = llguidance.LLTokenizer(header["tokenizer"], n_vocab=header["vocab_size"], eos_token=list(eos) or None)
    write_frame(stdout, {"ready": True})
    while (request := read_frame(stdin)) is not None:
        write_frame(stdout, build(tokenizer, eos, request))
    return 0


if __name__ == "__main__":
    sys.exit(main())
