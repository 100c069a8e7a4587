"""`python -m evalkit.calibrate` (evalkit.calibrate.main)."""

from evalkit.calibrate.main import main

if __name__ == "__main__":
    raise SystemExit(main())
