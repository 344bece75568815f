"""`python -m infinity ...`: the same CLI as the `infinity` command (for environments without its script)."""

import sys

from infinity.cli import main

if __name__ == "__main__":
    sys.exit(main())
