"""Reports of one or more runs, with no torch: report.html, report.md and PNG plots (evalkit.report.build).

python -m evalkit.report results/RUN [results/RUN2 ...] [--out DIR]
"""

import argparse
from pathlib import Path

from evalkit.exits import guarded
from evalkit.report.build import report


def main(argv: list[str] | None = None) -> int:
    def run() -> int:
        ap = argparse.ArgumentParser(prog="python -m evalkit.report", description=__doc__.splitlines()[0])
        ap.add_argument("runs", nargs="+", type=Path)
        ap.add_argument("--out", type=Path, default=None, help="output folder (default: RUN/report)")
        args = ap.parse_args(argv)
        out = args.out or args.runs[0] / "report"
        written = report(args.runs, out)
        print("\n".join(str(p) for p in written))
        return 0

    return guarded(run)


if __name__ == "__main__":
    raise SystemExit(main())
