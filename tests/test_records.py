"""The record schema (evalkit.records.schema): rows paired with the baseline, a malformed row refused where it is
built, and run.json read back whole (the keys evalkit no longer writes kept as they were)."""

from __future__ import annotations

import json

import pytest

from evalkit.errors import ConfigError
from evalkit.records import BASELINE, Result, RunInfo, pair, write_json

HEAD = {"run_id": "r1", "task": "needle", "protocol": "query_agnostic"}
SAMPLE = {"sample_id": "s0", "cell": {"depth": 0.5}, "question": "q?", "answers": ["42"]}


def test_rows_are_paired_with_the_baseline_of_their_sample():
    results = [
        Result(BASELINE, "42", {"kv_bytes": 100, "kv_bytes_deployed": 50}, 1.0),
        Result("h2o@0.5", "41", {"kv_bytes": 40, "kv_bytes_deployed": 20}, 0.0),
        Result("knorm@0.5", "42", {"kv_bytes": 40, "kv_bytes_deployed": 20}, 1.0),
    ]
    rows = [r.to_dict() for r in pair(HEAD, SAMPLE, results)]
    assert [(r["variant"], r["score"], r["baseline_score"], r["flip"]) for r in rows] == [
        (BASELINE, 1.0, 1.0, None),
        ("h2o@0.5", 0.0, 1.0, "lost"),
        ("knorm@0.5", 1.0, 1.0, None),
    ]
    assert all(r["kv_bytes_baseline"] == 100 and r["kv_bytes_baseline_deployed"] == 50 for r in rows)
    assert all(r["run_id"] == "r1" and r["question"] == "q?" and r["cell"] == {"depth": 0.5} for r in rows)
    assert rows[1]["prediction"] == "41" and rows[1]["kv_bytes"] == 40
    # a teacher-forced continuation is scored against the baseline's logits: no flip
    assert {r.flip for r in pair(HEAD, SAMPLE, results, flips=False)} == {None}


def test_an_engine_answer_without_text_has_no_prediction_and_an_unscored_one_is_not_paired():
    rows = pair(HEAD, SAMPLE, [Result(BASELINE, None, {"response": [[-1.5, True]]}, 1.0)])
    assert "prediction" not in rows[0].to_dict() and rows[0].to_dict()["response"] == [[-1.5, True]]
    with pytest.raises(ValueError, match="scored before it is paired"):
        pair(HEAD, SAMPLE, [Result(BASELINE, "42")])


@pytest.mark.parametrize(
    ("result", "field"),
    [(Result("", "42", {}, 1.0), "variant"), (Result("v", "42", {}, "1.0"), "score")],
)
def test_a_malformed_row_is_refused_where_it_is_built(result, field):
    with pytest.raises(ValueError, match=f"bad {field}"):
        pair(HEAD, SAMPLE, [Result(BASELINE, "42", {}, 1.0), result])


def test_run_json_reads_back_whole(tmp_path):
    info = RunInfo(run_id="r1", config={"seed": 0}, protocol="query_agnostic", seed=0)
    info.update({"model": {"fingerprint": "abc"}, "endpoints_checked": 2})
    path = tmp_path / "run.json"
    write_json(path, {**info.to_dict(), "looks": [{"look": 1}]})  # a key an older gate wrote
    back = RunInfo.read(path)
    assert back.model == {"fingerprint": "abc"} and back.other == {"endpoints_checked": 2, "looks": [{"look": 1}]}
    assert back.to_dict() == json.loads(path.read_text())
    assert "prepared" not in back.to_dict()  # a field never set is no key
    path.write_text('{"config": {}}')
    with pytest.raises(ConfigError, match="is not an evalkit run.json"):
        RunInfo.read(path)
