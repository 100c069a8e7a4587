"""No route re-judges for free: every look, the first included, is the betting test, so a report's peek, deleted
looks, a fresh folder or gates run at once change no verdict; the looks are an append-only record (looks.jsonl,
written under the run's lock) checked against the rows; the report and the planner show the gate's verdict.json only
for the rows it judged; the cell check holds at every look; the advice's own command extends the same folder."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from evalkit.cli.gate import main
from evalkit.lock import RunLock
from evalkit.plan.measured import measured_variants
from evalkit.records import looks
from evalkit.records.looks import LOOKS_FILE
from evalkit.records.reading import read_runs
from evalkit.report.__main__ import main as report_main
from evalkit.thresholds import Thresholds
from tests.conftest import ROOT, drew, judge_rows, run_cli
from tests.test_gate import rows, run_info

THETAS = (1, 0.8, 0.6, 0.4)  # evalkit.stats.betting's bets, weighted 1/4 each


def drop_wealth(lost: int, n: int, margin: float = 0.05) -> float:
    """By hand: the mixture wealth of "the drop is below the margin" after n one-question contexts, `lost` of them lost
    (a loss multiplies a bet theta by 1 - theta, an unchanged context by 1 + theta margin / (1 - margin))."""
    return sum(0.25 * (1 - th) ** lost * (1 + th * margin / (1 - margin)) ** (n - lost) for th in THETAS)


def _write(folder: Path, base: list[float], pol: list[float], cell=None) -> Path:
    """The run folder holding these rows (its run.json's samples extended as resume=true extends them)."""
    folder.mkdir(parents=True, exist_ok=True)
    written = rows(base, pol, cell=cell)
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in written))
    info = json.loads((folder / "run.json").read_text()) if (folder / "run.json").exists() else run_info("r1")
    (folder / "run.json").write_text(json.dumps(drew(info, written)))
    return folder


def _looks(folder: Path) -> list[dict]:
    path = folder / LOOKS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _page_status(out: Path) -> str:
    return re.search(r'id="verdict-status"[^>]*>([^<]*)<', (out / "report.html").read_text()).group(1)


# --- a look the report takes, looks deleted, looks taken at once ---------------------------------------------------


def test_a_report_peek_judges_nothing_and_the_gate_bets_at_every_look(tmp_path, capsys):
    # once: the report judged (INCONCLUSIVE, "look 1") and wrote no look; 60 samples later the gate's exact
    # "first look" PASSed (0.95^60 < 0.05). Now the report shows no verdict and judges nothing, and the gate bets:
    # 60 lossless contexts do not reach the wealth 20, 74 do
    assert 0.95**60 < 0.05 and drop_wealth(0, 60) < 20 <= drop_wealth(0, 74)
    run = _write(tmp_path / "run", [1] * 20, [1] * 20)
    assert report_main([str(run), "--out", str(tmp_path / "peek")]) == 0
    assert _page_status(tmp_path / "peek") == "NO VERDICT"
    page = (tmp_path / "peek" / "report.html").read_text()
    assert "no verdict for these rows: run python -m evalkit.gate" in page
    assert _looks(run) == [] and not (run / "verdict.json").exists()
    _write(run, [1] * 60, [1] * 60)
    assert main([str(run)]) == 2
    assert "evalkit gate: INCONCLUSIVE (look 1 of this run)" in capsys.readouterr().out
    assert report_main([str(run), "--out", str(tmp_path / "after")]) == 0  # the gate's verdict, shown, not a look
    assert _page_status(tmp_path / "after") == "INCONCLUSIVE" and len(_looks(run)) == 1
    _write(run, [1] * 74, [1] * 74)  # the positive control: a lossless run PASSes once betting shows it
    assert main([str(run)]) == 0
    assert "evalkit gate: PASS (look 2 of this run)" in capsys.readouterr().out
    assert [(x["look"], x["verdict"]) for x in _looks(run)] == [(1, "INCONCLUSIVE"), (2, "PASS")]
    assert _looks(run)[1]["variants"]["snapkv@0.25"] == {"contexts": 74, "questions": 74, "cells": {"depth=0.5": 74}}
    assert "looks" not in json.loads((run / "run.json").read_text())  # looks live in looks.jsonl, not run.json


def test_deleted_looks_change_nothing_in_the_verdict(tmp_path):
    # once: 1 lost of 130 was INCONCLUSIVE at look 3 of 20 -> 60 -> 130, and PASSed with the looks deleted. By
    # hand 1 lost of 130 reaches a wealth of 18, below 20: INCONCLUSIVE however the looks went
    assert drop_wealth(1, 130) < 20
    pol = [0] + [1] * 129
    verdicts = {}
    for route in ("kept", "deleted"):
        run = tmp_path / route
        for n in (20, 60, 130):
            if route == "deleted":  # a fresh folder, a CI job in a fresh workspace: no looks before this one
                (run / LOOKS_FILE).unlink(missing_ok=True)
                if (run / "run.json").exists():
                    info = json.loads((run / "run.json").read_text())
                    info.pop("looks", None)
                    (run / "run.json").write_text(json.dumps(info))
            _write(run, [1] * n, pol[:n])
            main([str(run)])
        doc = json.loads((run / "verdict.json").read_text())
        verdicts[route] = (doc["verdict"], doc["variants"]["snapkv@0.25"]["gate"]["checks"])
    assert verdicts["kept"] == verdicts["deleted"] and verdicts["kept"][0] == "INCONCLUSIVE"


def _thresholds(tmp_path: Path, drop: float) -> Path:
    path = tmp_path / f"gate-{drop}.yaml"
    path.write_text(f"name: g{drop}\nmax_drop: {drop}\nmin_baseline_accuracy: null\n")
    return path


def test_three_gates_at_once_take_turns_and_number_their_looks_1_2_3(tmp_path):
    # three gates with three thresholds (three different looks) started together while the run's lock is held: none
    # judges before the lock is free, then each appends its own look under the lock, numbered one after the other
    run = _write(tmp_path / "run", [1] * 30, [1] * 30)
    gates = [_thresholds(tmp_path, d) for d in (0.05, 0.06, 0.07)]
    with RunLock(run):
        procs = [
            subprocess.Popen([sys.executable, "-m", "evalkit.gate", str(run), "--gate", str(g)], cwd=ROOT, text=True)
            for g in gates
        ]
        time.sleep(3)
        assert all(p.poll() is None for p in procs) and _looks(run) == []  # they wait for the lock
    assert [p.wait(timeout=120) for p in procs] == [2, 2, 2]
    looks = _looks(run)
    assert sorted(x["look"] for x in looks) == [1, 2, 3]
    assert sorted(x["thresholds"]["max_drop"] for x in looks) == [0.05, 0.06, 0.07]


# --- look records that do not match the rows --------------------------------------------------------------------


def _cannot(capsys, run: Path) -> str:
    assert main([str(run)]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return json.loads((run / "verdict.json").read_text())["reasons"][0]


def test_an_edited_look_record_is_cannot_judge_naming_the_line(tmp_path, capsys):
    run = _write(tmp_path / "run", [1] * 20, [1] * 20)
    assert main([str(run)]) == 2
    honest = (run / LOOKS_FILE).read_text()
    record = json.loads(honest)
    # look: "one" (once a traceback)
    (run / LOOKS_FILE).write_text(json.dumps({**record, "look": "one"}) + "\n")
    assert _cannot(capsys, run).startswith(f'{run / LOOKS_FILE}:1: look record has look "one"')
    # a first look that counts more contexts than the rows hold
    more = {**record, "variants": {"snapkv@0.25": {"contexts": 59, "questions": 59, "cells": {"depth=0.5": 59}}}}
    (run / LOOKS_FILE).write_text(json.dumps(more) + "\n")
    assert "look 1 counts 59 contexts and 59 questions of snapkv@0.25, the rows hold 20 and 20" in _cannot(capsys, run)
    # the same rows (its digest) at other thresholds
    (run / LOOKS_FILE).write_text(json.dumps({**record, "thresholds": {**record["thresholds"], "max_drop": 0.5}}))
    assert "judged these rows at other thresholds than its digest" in _cannot(capsys, run)
    # not JSON at all, on line 2
    (run / LOOKS_FILE).write_text(honest + "{not json\n")
    assert _cannot(capsys, run).startswith(f"{run / LOOKS_FILE}:2: look record is not a JSON object")
    # the honest record judges again: the same look
    (run / LOOKS_FILE).write_text(honest)
    assert main([str(run)]) == 2 and _looks(run) == [record]


def test_an_older_run_json_look_list_counts_and_is_checked(tmp_path, capsys):
    run = _write(tmp_path / "run", [1] * 20, [1] * 20)
    info = json.loads((run / "run.json").read_text())
    old = {"look": 1, "digest": "sha256:0", "thresholds": {}, "variants": {}, "verdict": "INCONCLUSIVE"}
    (run / "run.json").write_text(json.dumps({**info, "looks": [{**old, "look": "one"}]}))
    assert _cannot(capsys, run).startswith(f'{run / "run.json"}: looks[0]: look record has look "one"')
    (run / "run.json").write_text(json.dumps({**info, "looks": [old]}))
    assert main([str(run)]) == 2 and [x["look"] for x in _looks(run)] == [2]  # history: the next look is 2


# --- a verdict.json the gate did not write for these rows -------------------------------------------------------


def test_a_planted_verdict_json_is_not_shown_as_the_gates(tmp_path):
    run = _write(tmp_path / "run", [1] * 20, [1] * 20)
    (run / "verdict.json").write_text(json.dumps({"verdict": "PASS", "runs": [str(run)], "thresholds": {}}))
    assert report_main([str(run), "--out", str(tmp_path / "out")]) == 0
    assert _page_status(tmp_path / "out") == "NO VERDICT"
    assert "exit code 0" not in (tmp_path / "out" / "report.html").read_text()
    [m] = measured_variants([run])
    assert m["status"] == "NO VERDICT" and m["why"].startswith("no verdict for these rows: run python -m evalkit.gate")
    # a verdict the gate wrote for other rows (another run's, copied in) is not these rows' either
    other = _write(tmp_path / "other", [1] * 80, [1] * 80)
    assert main([str(other)]) == 0
    doc = json.loads((other / "verdict.json").read_text())
    (run / "verdict.json").write_text(json.dumps({**doc, "runs": [str(run)]}))
    assert report_main([str(run), "--out", str(tmp_path / "out2")]) == 0
    assert _page_status(tmp_path / "out2") == "NO VERDICT"
    # the gate's own verdict for these rows is shown, by report and planner alike
    assert main([str(other)]) == 0
    assert report_main([str(other), "--out", str(tmp_path / "out3")]) == 0
    assert _page_status(tmp_path / "out3") == "PASS" and measured_variants([other])[0]["status"] == "PASS"


# --- the cell check at every look -------------------------------------------------------------------------------


def _cell_case(n: int) -> tuple[list[int], list[int], object]:
    """n rows over 10 cells (row i in cell i % 10); in cell 0 the baseline is right on 3 of every 5 samples and the
    policy on 1 of them (0.60 against 0.20), elsewhere both are always right."""
    base, pol = [], []
    for i in range(n):
        k = i // 10
        bad = i % 10 == 0
        base.append(1 if not bad or k % 5 < 3 else 0)
        pol.append(1 if not bad or k % 5 == 0 else 0)
    return base, pol, lambda i: {"cell": i % 10}


def test_the_cell_check_holds_at_a_later_look(tmp_path, capsys):
    # once: 800 rows FAILed judged fresh (a cell at 0.20 against a baseline of 0.60), but PASSed at look 2
    # after an INCONCLUSIVE look at 160 ("can be shown from 1000000000"). Every look bets on the cell now, at the
    # error rate it is given (Holm over 10 cells), so look 2 FAILs as a fresh judgement does.
    run = tmp_path / "run"
    base, pol, cell = _cell_case(160)
    _write(run, base, pol, cell)
    assert main([str(run)]) == 2
    capsys.readouterr()
    base, pol, cell = _cell_case(800)
    _write(run, base, pol, cell)
    fresh = judge_rows(rows(base, pol, cell=cell), [], Thresholds())
    assert fresh.status == "FAIL"
    assert main([str(run)]) == 1
    assert "evalkit gate: FAIL (look 2 of this run)" in capsys.readouterr().out
    doc = json.loads((run / "verdict.json").read_text())
    [bad] = [c for c in doc["cells"] if c["cell"] == "cell=0"]
    assert bad["status"] == "shown to fail" and bad["policy"] == 0.2 and bad["baseline"] == 0.6
    assert any("cell cell=0: accuracy 0.20 (baseline 0.60, n=80) shown below 0.5" in r for r in doc["reasons"])
    assert not any("1000000000" in str(c["status"]) for c in doc["cells"])


# --- the advice's own command continues the run -----------------------------------------------------------------

TINY = ["model=tiny-random", "task.context_lengths=[128]", "task.depths=[0.0,1.0]"]


def test_the_advices_command_extends_the_same_folder_and_its_looks(tmp_path):
    # once: appending the advice's `task.samples_per_cell=N resume=true` to the run's command wrote a new
    # folder (its name was built from the count), judged as "look 1 of this run"
    root = tmp_path / "results"
    gate = ["gate=default", "gate.min_baseline_accuracy=null"]
    first = run_cli(*TINY, "task.samples_per_cell=1", *gate, f"results_root={root}")
    assert first.returncode == 2, first.stderr
    [folder] = [p.parent for p in root.rglob("samples.jsonl")]
    advice = json.loads((folder / "verdict.json").read_text())["advice"]
    setting = re.search(r"e\.g\. (task\.samples_per_cell=\d+) resume=true", advice).group(1)
    again = run_cli(*TINY, setting, "resume=true", *gate, f"results_root={root}")
    assert again.returncode in (0, 1, 2), again.stderr
    assert [p.parent for p in root.rglob("samples.jsonl")] == [folder]
    assert [x["look"] for x in _looks(folder)] == [1, 2]
    assert len(read_runs([folder]).rows) > 2 * 2  # the new samples are in the same folder


def test_a_look_that_cannot_be_recorded_is_said_not_hidden(tmp_path, capsys, monkeypatch):
    run = _write(tmp_path / "run", [1] * 20, [1] * 20)

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(looks.os, "fsync", full_disk)
    assert main([str(run), "--out", str(tmp_path / "out")]) == 2
    assert f"{run / LOOKS_FILE}: look 1 not recorded (No space left on device)" in capsys.readouterr().out
    assert "not recorded" in "\n".join(json.loads((tmp_path / "out" / "verdict.json").read_text())["not_judged"])
