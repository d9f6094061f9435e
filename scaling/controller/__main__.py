"""`python -m scaling.controller`: see scaling.controller.cli."""

import sys

from scaling.controller.cli import main

sys.exit(main())
