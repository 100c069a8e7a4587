"""How fast the command line answers: a mistyped policy name against composing the bare Hydra config, in the same
venv, interleaved run by run so that both see the same machine load.

    python benchmarks/cli_startup.py [--runs 7]

Prints the median seconds of each and their ratio (the goal: a typo within 3x a bare compose), then the modules that
`python -X importtime` says the typo path imports, heaviest first, so that a regression names its culprit.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BARE = (
    "from hydra import compose, initialize_config_module\n"
    "with initialize_config_module(config_module='evalkit.conf', version_base='1.3'):\n"
    "    compose(config_name='config')\n"
)
COMMANDS = {
    "bare compose of conf/config.yaml": [sys.executable, "-c", BARE],
    "python -m evalkit policy=snapkvv": [sys.executable, "-m", "evalkit", "policy=snapkvv"],
    "python -m evalkit --help": [sys.executable, "-m", "evalkit", "--help"],
    "python -m evalkit.gate --plan": [sys.executable, "-m", "evalkit.gate", "--plan"],
}


def seconds(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, capture_output=True, check=False)
    return time.perf_counter() - t


def heaviest(cmd: list[str], k: int = 8) -> list[tuple[int, str]]:
    """The k top-level imports with the largest cumulative time (microseconds) under -X importtime."""
    err = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], cwd=ROOT, capture_output=True, text=True).stderr
    rows = []
    for line in err.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cumulative, name = (part.strip() for part in line.removeprefix("import time:").split("|"))
            if cumulative.isdigit() and not name.startswith(" "):
                rows.append((int(cumulative), name))
    return sorted(rows, reverse=True)[:k]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.runs):
        for name, cmd in COMMANDS.items():
            times[name].append(seconds(cmd))
    bare = statistics.median(times["bare compose of conf/config.yaml"])
    print(f"{'command':<36} {'median s':>9} {'min s':>7} {'x bare':>7}")
    for name, ts in times.items():
        print(f"{name:<36} {statistics.median(ts):>9.2f} {min(ts):>7.2f} {statistics.median(ts) / bare:>6.2f}x")
    print("\nheaviest imports of `python -m evalkit policy=snapkvv` (cumulative ms):")
    for us, name in heaviest(COMMANDS["python -m evalkit policy=snapkvv"]):
        print(f"  {us / 1000:>8.1f}  {name}")


if __name__ == "__main__":
    main()
