"""`python -m infinity ...`: the same CLI as the `infinity` command (for environments without its script)."""

import sys

from infinity.cli import main

sys.exit(main())
