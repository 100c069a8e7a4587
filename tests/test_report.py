"""Reports: Markdown, PNG plots and the page (W&B: tests/test_wandb.py)."""

from __future__ import annotations

import json
import re

from evalkit.report.build import pareto, report
from tests.conftest import as_rows, drew
from tests.test_gate import rows, run_info


def needle_rows():
    cell = lambda i: {"context_length": [1024, 2048][i % 2], "depth": [0.0, 0.5, 1.0][i % 3]}  # noqa: E731
    out = rows(
        [1] * 12,
        [0 if i % 3 == 1 else 1 for i in range(12)],
        "streaming_llm@0.25",
        cell=cell,
        retained=lambda i: [0.0, 0.1],
    )
    out += [r for r in rows([1] * 12, [1] * 12, "snapkv@0.5", cell=cell, kv=(50, 100)) if r["variant"] != "baseline"]
    return out


def write_run(path, records, info=None):
    path.mkdir(parents=True)
    (path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (path / "run.json").write_text(json.dumps(drew(info or run_info("r1"), records)))
    return path


def test_pareto_front_keeps_the_undominated_points():
    pts = [(0.75, 0.2, "a"), (0.5, 1.0, "b"), (0.5, 0.5, "c"), (0.0, 1.0, "base")]
    assert [p[2] for p in pareto(pts)] == ["b", "a"]


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's signature and IHDR chunk; fails on anything that is not a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR" and data[-8:-4] == b"IEND", f"{path.name} is a truncated PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def table(md: str) -> dict[str, dict[str, str]]:
    """The report's variant table: per variant, its cells by column header."""
    lines = [line for line in md.splitlines() if line.startswith("|")]
    start = next(i for i, line in enumerate(lines) if line.startswith("| variant |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    out = {}
    for line in lines[start + 2 :]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != len(header):
            break
        out[cells[0]] = dict(zip(header, cells, strict=True))
    return out


def column(row: dict[str, str], prefix: str) -> str:
    (name,) = [h for h in row if h.startswith(prefix)]
    return row[name]


def test_report_writes_markdown_html_and_plots_merging_runs(tmp_path, capsys):
    recs = needle_rows()
    write_run(tmp_path / "multirun" / "0", [r for r in recs if r["variant"] != "snapkv@0.5"])
    write_run(tmp_path / "multirun" / "1", [r for r in recs if r["variant"] != "streaming_llm@0.25"])
    out = tmp_path / "out"
    files = report([tmp_path / "multirun"], out)
    assert all(f.parent == out and f.is_file() and f.stat().st_size > 0 for f in files)
    names = {f.name for f in files}
    assert {"report.md", "report.html", "heatmaps.png", "tradeoff.png", "flips.png"} <= names
    pngs = sorted(f.name for f in files if f.suffix == ".png")
    assert sorted(p.name for p in out.glob("*.png")) == pngs  # every plot the report lists, and no other
    for name in pngs:
        width, height = png_size(out / name)
        assert width > 100 and height > 100, name
    heat_w, heat_h = png_size(out / "heatmaps.png")
    assert heat_w > 2 * heat_h  # three panels side by side: baseline, snapkv@0.5, streaming_llm@0.25

    md = (out / "report.md").read_text()
    rows = table(md)
    # By hand from needle_rows: 12 samples; streaming_llm@0.25 fails every sample at depth 0.5 (i % 3 == 1: 4 of 12)
    # where the baseline succeeds, with evidence retention 0.0 and 0.1 (mean 0.05 < 0.5: evicted); it holds 25 of
    # 100 bytes. McNemar: 4 discordant pairs, all lost: p = 2 * (1/2)^4 = 0.125. snapkv@0.5 loses nothing, holds 50
    # of 100. The baseline, repeated by both runs, is counted once.
    assert set(rows) == {"baseline", "streaming_llm@0.25", "snapkv@0.5"}
    sl, snap, base = rows["streaming_llm@0.25"], rows["snapkv@0.5"], rows["baseline"]
    assert (sl["n"], sl["baseline"], sl["policy"], sl["McNemar p"]) == ("12", "1.00", "0.67", "0.125")
    assert column(sl, "drop").startswith("+0.333 ") and sl["lost (evicted/ignored)"] == "4 (4/0)"
    assert column(sl, "KV ratio") == "0.250x"
    assert (snap["n"], snap["baseline"], snap["policy"], snap["McNemar p"]) == ("12", "1.00", "1.00", "1")
    assert column(snap, "drop").startswith("+0.000 ") and snap["lost (evicted/ignored)"] == "0 (0/0)"
    assert column(snap, "KV ratio") == "0.500x"
    assert (base["n"], base["baseline"], base["policy"], column(base, "KV ratio")) == ("12", "1.00", "1.00", "1.000x")
    for name in pngs:  # the Markdown shows every plot written
        assert f"![{name.removesuffix('.png')}]({name})" in md
    page = (out / "report.html").read_text()  # the page: tests/test_report_page.py reads it, the browser test opens it
    assert "Plotly" in page and not re.search(r'<(script|link|img)[^>]+(src|href)="(https?:)?//', page)  # offline
    assert "Warnings" not in md and "warning" not in capsys.readouterr().err  # healthy records: no warnings


def test_merging_runs_of_two_models_keeps_their_variants_apart(tmp_path):
    from evalkit.records.merged import merge

    recs = needle_rows()
    runs = [
        (
            tmp_path / name,
            {"model": {"name": name}},
            as_rows([r for r in recs if r["variant"] in ("baseline", "streaming_llm@0.25")]),
        )
        for name in ("model-a", "model-b")
    ]
    merged = merge(runs)
    labels = {r["variant"] for r in merged}
    assert labels == {f"{m}/{v}" for m in ("model-a", "model-b") for v in ("baseline", "streaming_llm@0.25")}
    assert len(merged) == 2 * sum(r["variant"] in ("baseline", "streaming_llm@0.25") for r in recs)
    # the same model twice: the repeated baseline is kept once, and nothing is prefixed
    recs = as_rows(recs)
    same = merge([(tmp_path / "x", {"model": {"name": "m"}}, recs), (tmp_path / "y", {"model": {"name": "m"}}, recs)])
    assert same == recs
