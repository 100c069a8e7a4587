"""`python -m evalkit.report` (evalkit.report.cli)."""

from evalkit.report.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
