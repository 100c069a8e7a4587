"""`python -m evalkit.lmeval`: lm-eval's own command line with the evalkit model (evalkit.lmeval.cli)."""

import sys

from evalkit.exits import guarded
from evalkit.lmeval.cli import main

if __name__ == "__main__":
    sys.exit(guarded(main))
