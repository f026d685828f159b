#!/usr/bin/env python3
"""Container health probe: exit 0 when the router's GET /health answers 200, else 1.

Standard library only, so it runs with the image's Python and needs no curl. /health is 200
while at least one worker is ready and 503 when none is (starting, all failed); a refused
connection (router not up yet) or a timeout counts as unhealthy too. The port is the one
the entry point binds: $HETSERVE_PORT, default 8000.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    port = os.environ.get("HETSERVE_PORT", "8000")
    url = f"http://127.0.0.1:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=float(os.environ.get("HETSERVE_HEALTH_TIMEOUT", "4"))) as r:
            print(f"{url}: {r.status} {r.read(300).decode(errors='replace')}")
            return 0
    except urllib.error.HTTPError as e:  # 503: no worker ready
        print(f"{url}: {e.code} {e.read(300).decode(errors='replace')}")
    except OSError as e:  # refused, timed out, unreachable
        print(f"{url}: {e}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
