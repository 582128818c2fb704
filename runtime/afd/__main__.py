import sys

from afd.cli import main

sys.exit(main())
