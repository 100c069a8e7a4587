"""What happens when a Hydra multirun ends (`python -m evalkit -m policy=h2o,snapkv policy.budget=0.25,0.5`): the
jobs' records, under the sweep folder, are merged into one report and, with gate=..., judged by one gate.

Registered as a Hydra callback (conf/config.yaml, hydra.callbacks), so it runs in the launching process whatever the
launcher (basic, joblib, submitit), once every job has returned.
"""

from __future__ import annotations

from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

# The gate's exit code for the sweep (0 PASS, 1 FAIL), read by evalkit.__main__ once Hydra returns; None: no gate.
exit_code: int | None = None


class MergeJobs(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        global exit_code
        from evalkit.errors import ConfigError
        from evalkit.gate import gate, print_verdict, thresholds
        from evalkit.report import report

        sweep = Path(config.hydra.sweep.dir)
        try:
            written = report([sweep], sweep / "report")
        except ConfigError as err:  # no job wrote records (all failed or were interrupted before a sample)
            print(f"evalkit: no merged report: {err}")
            return
        print(f"evalkit: merged report of the sweep: {written[0]}")
        if config.gate.name != "none":
            verdict = gate([sweep], thresholds(config.gate, repr(config.gate.name)))
            print_verdict(verdict)
            exit_code = 0 if verdict.passed else 1
