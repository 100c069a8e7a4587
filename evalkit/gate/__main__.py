"""`python -m evalkit.gate` (evalkit.gate.cli)."""

from evalkit.gate.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
