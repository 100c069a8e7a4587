"""Process-wide state is the command line's: nothing is installed or registered when a module is imported; the
command line installs the Ctrl-C handler and registers the folder resolvers at start-up (a sweep's worker when it
receives its job) and passes the stop request down. Each check runs in a fresh interpreter, whose signal handlers and
resolvers no other test has touched."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import ROOT


def python(code: str) -> str:
    """`code` run by a fresh interpreter in the repository, with the variables the old design read set; its stdout."""
    env = {"EVALKIT_DEFER_SIGINT": "1", "EVALKIT_STOP_REQUESTED": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


def test_importing_the_command_line_installs_no_handler_and_registers_no_resolver():
    out = python(
        """
        import signal
        from omegaconf import OmegaConf
        from evalkit.cli import main
        from evalkit.run import interrupt
        print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, OmegaConf.has_resolver("evalkit_safe"))
        main.register_resolvers()
        print(OmegaConf.has_resolver("evalkit_safe"), interrupt.Stop().requested())
        """
    )
    assert out.splitlines() == ["True False", "True False"]


def test_the_first_ctrl_c_asks_the_stop_the_second_raises():
    out = python(
        """
        import os, signal
        from evalkit import sigint
        from evalkit.run.interrupt import Stop
        stop = Stop()
        with stop.deferred():
            os.kill(os.getpid(), signal.SIGINT)
            print(stop.requested(), sigint.received())
            try:
                os.kill(os.getpid(), signal.SIGINT)
                print("no raise")
            except KeyboardInterrupt:
                print("raised")
        print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        """
    )
    assert out.splitlines() == ["True True", "raised", "True"]


def test_a_job_sent_to_a_worker_sets_the_worker_up_and_carries_the_stop_request():
    """What a sweep's worker process does on receiving a job (HydraJob unpickled): the resolvers registered, Ctrl-C
    deferred to one stop for the whole worker, the stop asked where the command's was when it sent the job."""
    out = python(
        """
        import os, pickle, signal
        from omegaconf import OmegaConf
        from evalkit.cli.main import HydraJob
        from evalkit.run.interrupt import Stop
        sent = pickle.dumps(HydraJob(Stop()))
        first = pickle.loads(sent)
        ours = Stop.of_this_process() is first.stop
        print(OmegaConf.has_resolver("evalkit_job_dirname"), first.stop.requested(), ours)
        os.kill(os.getpid(), signal.SIGINT)  # the worker's own Ctrl-C between two jobs
        second = pickle.loads(sent)  # a job its command sent before the Ctrl-C
        print(second.stop is first.stop, second.stop.requested())
        third = pickle.loads(pickle.dumps(HydraJob(Stop(requested=True))))
        print(third.stop is first.stop, third.stop.requested())
        """
    )
    assert out.splitlines() == ["True False True", "True True", "True True"]
