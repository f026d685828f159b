"""`python -m workers.kernelize --arch sm_90 ...`: the preflight's command line (see `workers.kernelize.cli`)."""

import sys

from workers.kernelize.cli import main

if __name__ == "__main__":
    sys.exit(main())
