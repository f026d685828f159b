"""`python -m workers --socket PATH ...`: one worker process (see `workers.main`)."""

import sys

from workers.main import main

if __name__ == "__main__":
    sys.exit(main())
