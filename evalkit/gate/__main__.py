"""`python -m evalkit.gate` (evalkit.cli.gate)."""

from evalkit.cli.gate import main

if __name__ == "__main__":
    raise SystemExit(main())
