"""`python -m etrain.cli`, as the `etrain` script."""

import sys

from etrain.cli import main

sys.exit(main())
