"""`python -m evalkit.gate` (evalkit.gate.command)."""

from evalkit.gate.command import main

if __name__ == "__main__":
    raise SystemExit(main())
