"""`python -m evalkit.lmeval`: lm-eval's own command line with the evalkit model (evalkit.cli.lmeval)."""

import sys

from evalkit.cli.lmeval import main
from evalkit.exits import guarded

if __name__ == "__main__":
    sys.exit(guarded(main))
