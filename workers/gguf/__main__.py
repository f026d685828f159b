"""`python -m workers.gguf PATH`: prepare the GGUF model at PATH (workers/gguf/prepare.py) and print
`{"dir": ..., "name": ...}` as one JSON line; a file we cannot serve prints its error and exits 2.
The router runs this in a subprocess, so that it reads GGUF files without importing the workers."""

from __future__ import annotations

import json
import sys

from workers.gguf.files import GGUFError, model_name
from workers.gguf.prepare import prepare


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m workers.gguf PATH", file=sys.stderr)
        return 2
    try:
        directory = prepare(argv[0])
    except GGUFError as e:
        print(str(e), file=sys.stderr)
        return 2
    print(json.dumps({"dir": str(directory), "name": model_name(argv[0])}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
