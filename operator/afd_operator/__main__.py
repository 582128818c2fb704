"""`python -m afd_operator`: see `afd_operator.cli`."""

import sys

from afd_operator.cli import main

sys.exit(main())
