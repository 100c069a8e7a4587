"""`python -m evalkit.plan` (evalkit.cli.plan)."""

from evalkit.cli.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
