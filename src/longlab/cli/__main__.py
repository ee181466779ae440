"""``python -m longlab.cli ...`` is ``longlab ...``."""

import sys

from . import main

sys.exit(main())
