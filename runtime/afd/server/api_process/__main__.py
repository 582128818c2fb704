"""`python -m afd.server.api_process FACTS`: an API process, as the engine core starts it."""

import sys

from afd.server.api_process.child import main

sys.exit(main(sys.argv))
