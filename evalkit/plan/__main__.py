"""`python -m evalkit.plan` (evalkit.plan.cli)."""

from evalkit.plan.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
