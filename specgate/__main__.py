"""`python -m specgate ...` is the `specgate` command."""

import sys

from specgate.cli import main

sys.exit(main())
