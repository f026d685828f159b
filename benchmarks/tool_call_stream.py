"""What reading tool calls out of a stream costs the router, per piece, as the stream grows.

    python benchmarks/tool_call_stream.py [--pieces 1000,2000,4000] [--rounds 3]

The router reads every streamed chat answer whose request has tools (`auto`, `required`) through
`ToolCallSplitter` (server/protocol/tool_parsers/splitter.py) on its event loop, one piece per
token. Three answers a client can make long (`required` tools, or a schema plus `logit_bias`), fed
piece by piece: (a) one call whose arguments are a long list, (b) a list of many small calls,
(c) one call whose argument is a long string. Prints the seconds each takes at each size (best
of the rounds) and the ratio to the smallest size: linear reading doubles with the pieces, a
re-reading of the whole region at every piece quadruples. No process or model is involved.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server.protocol.tool_parsers.splitter import ToolCallSplitter  # noqa: E402
from server.protocol.tool_parsers.syntax import REQUIRED  # noqa: E402

NAMES = ("get_weather", "get_time")


def long_arguments(n: int) -> list[str]:
    """One call whose arguments hold a list of `n` short strings, a piece each."""
    return ['[{"name": "get_weather", "arguments": {"cities": [', *(f'"c{i}", ' for i in range(n - 1)), '"z"]}}]']


def many_calls(n: int) -> list[str]:
    """About n / 4 calls, each in four pieces."""
    out = ["["]
    for i in range(n // 4):
        out += ['{"name": "get_time", ', '"arguments": ', '{"zone": ', f'"z{i}"}}}}, ' if i < n // 4 - 1 else '"z"}}]']
    return out


def long_string(n: int) -> list[str]:
    """One call whose one argument is a string of `n` pieces."""
    return ['[{"name": "get_weather", "arguments": {"city": "', *("abc " for _ in range(n)), '"}}]']


CASES = {"long arguments": long_arguments, "many calls": many_calls, "long string": long_string}


def read(pieces: list[str]) -> float:
    splitter = ToolCallSplitter(REQUIRED, NAMES)
    t0 = time.perf_counter()
    for piece in pieces:
        splitter.feed(piece)
    splitter.finish()
    elapsed = time.perf_counter() - t0
    assert splitter.valid and splitter.calls, "the benchmark's answer must be read as calls"
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pieces", default="1000,2000,4000")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sizes = [int(s) for s in args.pieces.split(",")]
    print(f"{'answer':<16}" + "".join(f"{n:>10} pieces" for n in sizes) + "   ratio to the first size")
    for name, make in CASES.items():
        times = [min(read(make(n)) for _ in range(args.rounds)) for n in sizes]
        ratios = " / ".join(f"{t / times[0]:.1f}" for t in times)
        print(f"{name:<16}" + "".join(f"{t:>15.4f} s" for t in times) + f"   {ratios}")


if __name__ == "__main__":
    main()
