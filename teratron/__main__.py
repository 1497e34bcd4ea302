"""`python -m teratron ...` (and `torchrun -m teratron train ...`)."""

import sys

from teratron.cli import main

sys.exit(main())
