"""lm-eval through evalkit's one sample loop: one prefill per document for every variant, and lm-eval's own command
line (`python -m evalkit.lmeval --model evalkit`) resuming a run killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("lm_eval", reason="pip install 'lm-eval>=0.4.9,<0.5' for the lm-eval integration")

from omegaconf import OmegaConf  # noqa: E402

from evalkit.cli.config import variants as parse_variants  # noqa: E402
from evalkit.cli.spec import model_spec  # noqa: E402
from evalkit.lmeval.evaluate import LmevalEngine, evaluate  # noqa: E402
from evalkit.records import SAMPLES, read_rows  # noqa: E402
from evalkit.run import interrupt  # noqa: E402
from evalkit.run.loop import run_samples  # noqa: E402
from evalkit.run.resume import start  # noqa: E402
from evalkit.tasks.lmeval import LmEvalTask  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
DOCUMENTS = 3  # evalkit_recall's first documents: one context each, its choices scored after it


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)


def parsed(specs: list[str]):
    return parse_variants(OmegaConf.create({"seed": 0, "variants": specs}))


def counted_run(tiny, specs: list[str], per_call: int | None = None) -> tuple[int, dict]:
    """How many forwards of more than one token (prefills: every decode step feeds one token) the model ran in an
    lm-eval run of evalkit_recall's first documents with `specs` (`per_call` documents per lm-eval call), and the
    run's Results by (sample, variant)."""
    prefills = []

    def count(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[1] > 1:
            prefills.append(ids.shape[1])

    hook = tiny.model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        task = LmEvalTask(tasks=["evalkit_recall"], limit=DOCUMENTS, documents_per_call=per_call)
        calls = list(evaluate(task, tiny, parsed(specs)))
    finally:
        hook.remove()
    rows = {(job.sample_id, r.variant): r for answered, _ in calls for job, results in answered for r in results}
    return len(prefills), rows


def test_an_lm_eval_document_is_prefilled_once_for_every_variant(tiny):
    """Three variants of an lm-eval task cost one prefill per document, as one variant does: the context is
    prefilled once, compressed for each, its choices scored on copies. Each variant answers as it does alone."""
    specs = ["snapkv@0.5", "knorm@0.5", "streaming_llm@16"]
    alone = [counted_run(tiny, [spec]) for spec in specs]
    together, rows = counted_run(tiny, specs)
    assert together == DOCUMENTS and [n for n, _ in alone] == [DOCUMENTS] * len(specs)
    assert len(rows) == DOCUMENTS * (1 + len(specs))
    for (_, lone), spec in zip(alone, specs, strict=True):
        for (sid, variant), r in lone.items():
            got = rows[(sid, variant)]
            assert got.score == r.score and got.fields["kv_bytes"] == r.fields["kv_bytes"], (spec, sid, variant)
            assert got.fields["response"] == r.fields["response"]


def test_documents_run_a_call_at_a_time_answer_as_in_one_call(tiny):
    """lm-eval numbers a call's requests by their place in the call: each document's row still carries its own
    KV bytes and context, as when every document runs in one call."""
    one_call, rows = counted_run(tiny, ["snapkv@0.5"])
    per_document, split = counted_run(tiny, ["snapkv@0.5"], per_call=1)
    assert one_call == per_document == DOCUMENTS and rows.keys() == split.keys()
    for key, r in rows.items():
        got = split[key]
        assert (got.score, got.fields["response"]) == (r.score, r.fields["response"]), key
        assert {k: got.fields[k] for k in ("kv_bytes", "context_id", "peak_kv_bytes")} == {
            k: r.fields[k] for k in ("kv_bytes", "context_id", "peak_kv_bytes")
        }, key
    assert len({r.fields["context_id"] for r in split.values()}) == DOCUMENTS


class CountingEngine(LmevalEngine):
    """lm-eval's engine counting the prefills (forwards of more than one token) of the model it loads, each by the
    length of its input; with `stop`, asking it once `stop_after` prefills ran (as a Ctrl-C during that document)."""

    def __init__(
        self, out, variants, stop: interrupt.Stop | None = None, stop_after: int = 0, per_call: int | None = 1
    ):
        task = LmEvalTask(tasks=["evalkit_recall"], limit=6, documents_per_call=per_call)
        tiny = model_spec(OmegaConf.load(ROOT / "conf" / "model" / "tiny-random.yaml"))
        super().__init__(tiny, "cpu", task, variants, out)
        self.prefills: list[int] = []
        self.stop, self.stop_after = stop, stop_after

    def open(self, jobs):
        opened = super().open(jobs)
        self.loaded.model.register_forward_pre_hook(self.count, with_kwargs=True)
        return opened

    def count(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[1] > 1:
            self.prefills.append(ids.shape[1])
            if self.stop is not None and len(self.prefills) == self.stop_after:
                self.stop.request()


def loop_run(engine: CountingEngine, out, resume: bool, stop: interrupt.Stop) -> None:
    """The sample loop over lm-eval's engine into `out`, as the lm-eval command line runs it."""
    out.mkdir(exist_ok=True)
    config = {"model": {"name": "tiny-random"}, "task": {"tasks": ["evalkit_recall"], "limit": 6}, "seed": 0}
    run_info = start(out, {**config, "protocol": "query_agnostic"}, resume, engine.task)
    run_samples(engine, out, run_info, engine.task, None, stop)


@pytest.mark.parametrize("per_call", [1, None])
def test_a_resumed_lm_eval_run_prefills_only_the_documents_left(tmp_path, per_call):
    """Stopped after two of six documents (one lm-eval call each), the resumed run prefills the four documents left,
    not the six (one context per document, prefilled once for every variant): the documents whose baseline and
    variant rows are written are neither prefilled nor decoded again, whether the rest run a call each or in one
    call (`per_call` None: lm-eval's `samples` name the four). Every row ends in samples.jsonl once, those of the
    first two documents as the first run wrote them. Before, the resumed run prefilled all six again."""
    out, variants = tmp_path / "run", parsed(["snapkv@0.5", "knorm@0.5"])
    stop = interrupt.Stop()
    first = CountingEngine(out, variants, stop, stop_after=2)
    with pytest.raises(interrupt.Interrupted):
        loop_run(first, out, False, stop)
    kept = (out / SAMPLES).read_bytes()
    assert len(first.prefills) == 2 and len(kept.splitlines()) == 2 * 3  # two documents, baseline and 2 variants
    resumed = CountingEngine(out, variants, per_call=per_call)
    loop_run(resumed, out, True, interrupt.Stop())
    assert len(resumed.prefills) == 4
    ids = [(r.sample_id, r.variant) for r in read_rows(out / SAMPLES)]
    names = ("baseline", "snapkv@0.5", "knorm@0.5")
    assert sorted(ids) == sorted((f"evalkit_recall/{i}", v) for i in range(6) for v in names)
    assert (out / SAMPLES).read_bytes().startswith(kept)
    calls = json.loads((out / "lm_eval_results.json").read_text())["calls"]  # the first run's two, then the rest's
    assert len(calls) == (6 if per_call else 3) and all(sorted(c) == sorted(names) for c in calls)


def lm_eval_cli(records, *extra: str) -> list[str]:
    """`python -m evalkit.lmeval --model evalkit` on 6 documents, one lm-eval call each, into `records`."""
    model_args = f"model=tiny-random,variant=snapkv@0.5,records={records},documents_per_call=1"
    args = ["--model", "evalkit", "--model_args", model_args + "".join(extra), "--tasks", "evalkit_recall"]
    return [sys.executable, "-m", "evalkit.lmeval", *args, "--limit", "6"]


def test_the_lm_eval_command_line_resumes_after_a_kill_9(tmp_path):
    """Killed (SIGKILL: no handler runs, the lock's holder gone) once some documents' rows are written, the same
    command with resume=True finishes the run: every document's baseline and variant row once, those written
    before the kill kept byte for byte. Without resume=True the folder is refused, nothing overwritten."""
    records = tmp_path / "records"
    env = {**os.environ, **OFFLINE, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(lm_eval_cli(records), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    rows, deadline = records / SAMPLES, time.time() + 300
    while not (rows.exists() and len(rows.read_bytes().splitlines()) >= 2) and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    kept = rows.read_bytes()
    written = [json.loads(line) for line in kept.splitlines() if line.endswith(b"}")]
    assert 2 <= len(written) < 12, "killed after some documents, before the last"

    refused = subprocess.run(lm_eval_cli(records), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "resume=true" in refused.stderr
    assert rows.read_bytes() == kept

    done = subprocess.run(
        lm_eval_cli(records, ",resume=True"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    final = read_rows(rows)
    assert sorted((r["sample_id"], r["variant"]) for r in final) == sorted(
        (f"evalkit_recall/{i}", v) for i in range(6) for v in ("baseline", "snapkv@0.5")
    )
    whole = kept[: kept.rfind(b"\n") + 1]  # a row torn by the kill is cut, and written again whole
    assert rows.read_bytes().startswith(whole)
    assert json.loads((records / "run.json").read_text())["resumed"]


def test_the_lm_eval_command_line_stops_on_ctrl_c_after_the_call_in_flight(tmp_path):
    """Ctrl-C (SIGINT) once some documents' rows are written: the call in flight finishes, its rows written whole,
    and the command exits 130 naming how to resume; resume=True then finishes the run."""
    records = tmp_path / "records"
    env = {**os.environ, **OFFLINE, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        lm_eval_cli(records), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    rows, deadline = records / SAMPLES, time.time() + 300
    while not (rows.exists() and len(rows.read_bytes().splitlines()) >= 2) and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    assert "resume=True" in err and "Traceback" not in err
    written = [json.loads(line) for line in rows.read_text().splitlines()]  # every row whole
    assert 2 <= len(written) < 12 and len(written) % 2 == 0, "stopped after a whole document, before the last"
    done = subprocess.run(
        lm_eval_cli(records, ",resume=True"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(read_rows(rows)) == 12
