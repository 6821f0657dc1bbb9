"""`python -m algorithms.commands ...`: the `meshrl` command."""

import sys

from algorithms.commands import main

sys.exit(main())
