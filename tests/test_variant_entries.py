"""`variants=[...]` entries that carry fields of their policy, `{variant:kvzap@0.5,weights_path:DIR}`: a learned
method's weights given per variant, and a display name with `/` that every output keeps whole (records, the report's
tables, legend and grids, the run folder)."""

from __future__ import annotations

import html
import json
import re

import pytest

from evalkit.cli.config import variants
from evalkit.cli.main import dirname
from evalkit.report.__main__ import main as report_main
from tests.conftest import WEIGHTS_TINY, compose_config, run_cli
from tests.test_report_page import read_page, texts

NEEDLE = ["model=tiny-random", "task.context_lengths=[128]", "task.depths=[0.5]", "task.samples_per_cell=2"]
KVZAP = f"{{variant:kvzap@0.5,weights_path:{WEIGHTS_TINY['kvzap']}}}"
SLASHED = "{variant:snapkv@0.5,name:snapkv/w16,window:16}"
# the labels: the derived policy part, the display name beside it in brackets when it differs (records.labels)
NAMES = {"kvzap@0.5", "snapkv[snapkv/w16]@0.5"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("entries") / "run"
    result = run_cli(*NEEDLE, f"variants=[{KVZAP},{SLASHED}]", f"hydra.run.dir={folder}")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
    return folder, rows


def test_an_entry_gives_its_policy_the_weights_and_fields_it_carries(run):
    _, rows = run
    by_variant = {r["variant"]: r for r in rows}
    assert set(by_variant) == {"baseline", *NAMES}
    assert by_variant["kvzap@0.5"]["policy"]["weights_path"] == str(WEIGHTS_TINY["kvzap"])
    slashed = by_variant["snapkv[snapkv/w16]@0.5"]["policy"]
    assert slashed["name"] == "snapkv/w16" and slashed["window"] == 16


def test_without_the_entrys_weights_kvzap_is_refused_in_one_line(tmp_path):
    result = run_cli(*NEEDLE, "variants=[kvzap@0.5]", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    # the variant named, its key as the entry writes it ({variant:kvzap@0.5,weights_path:DIR}), not policy.weights_path
    assert "variants: kvzap@0.5: kvzap needs its surrogate models: give weights_path=DIR" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("{variant:snapkv@0.5,weights:3}", "variants: 'snapkv@0.5' has no policy field 'weights'; its fields are ["),
        ("{weights_path:w.pt}", "names no variant; write it as '{variant:kvzap@0.25,weights_path:DIR}'"),
    ],
)
def test_a_bad_entry_is_one_line_and_exit_2(tmp_path, entry, message):
    result = run_cli(*NEEDLE, f"variants=[{entry}]", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_the_report_keeps_a_name_with_a_slash_whole(run, tmp_path):
    folder, _ = run
    assert report_main([str(folder), "--out", str(tmp_path / "report")]) == 0
    page = read_page(tmp_path / "report" / "report.html")
    shown = {texts(r)[1] for r in page.tables["variant-table"][1:]}
    assert NAMES <= shown and not {"w16]@0.5", "snapkv[snapkv"} & shown
    text = (tmp_path / "report" / "report.html").read_text()
    assert NAMES <= {html.unescape(h) for h in re.findall(r"<h4>(.*?)</h4>", text)}  # the cells grids' titles
    legend = {html.unescape(t["name"]) for t in page.figures["tradeoff-plot"]["data"] if t["mode"] == "markers"}
    assert NAMES <= legend
    md = (tmp_path / "report" / "report.md").read_text()
    assert all(f"| {name} |" in md for name in NAMES)


def test_the_run_folder_of_an_entry_with_a_slash_is_one_folder():
    cfg = compose_config(*NEEDLE, f"variants=[{SLASHED}]")
    name = dirname([f"variants=[{SLASHED}]"])
    assert "/" not in name and name.startswith("variants=")
    assert [v.name for v in variants(cfg)] == ["snapkv[snapkv/w16]@0.5"]
