"""The report and the plan in a real browser: headless Chromium (Debian's `chromium` and `chromium-driver`, driven by
selenium; nothing is downloaded) opens the pages of real runs and checks what a reader sees.

CI installs Chromium (.ci/run) and sets EVALKIT_REQUIRE_BROWSER=1, so there a missing browser fails instead of
skipping. The checks return what is wrong, so the same checks are shown to catch a broken page (the last test).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_report_page import read_page, texts

webdriver = pytest.importorskip("selenium.webdriver", reason="pip install -e '.[dev]' (selenium)")
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
# What works headless on these machines (no GPU, no sandbox as root, no network at all)
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,900",
)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (Path(CHROMIUM).is_file() and Path(DRIVER).is_file()):
        if os.environ.get("EVALKIT_REQUIRE_BROWSER"):
            raise RuntimeError(f"EVALKIT_REQUIRE_BROWSER is set but {CHROMIUM} or {DRIVER} is missing")
        pytest.skip("apt-get install chromium chromium-driver to test the pages in a browser")
    options = Options()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))  # the given driver: no Selenium Manager
    driver.set_page_load_timeout(120)
    yield driver
    driver.quit()


def console_errors(driver) -> list[str]:
    """Errors logged since the last call: console.error, uncaught exceptions, resources that failed to load."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def open_page(driver, path: Path, plot: str) -> list[str]:
    """Load a page from its file and wait until Plotly has drawn `plot`; return the console's errors."""
    driver.get(path.as_uri())
    wait = WebDriverWait(driver, 60)
    wait.until(lambda d: d.execute_script("return document.readyState") == "complete")
    try:
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#{plot} .main-svg"))
    except Exception:  # noqa: BLE001 - the plot not drawn is a finding, reported with the console's errors
        return [*console_errors(driver), f"#{plot} was not drawn"]
    return console_errors(driver)


def shown_rows(driver) -> list[tuple[str, str]]:
    rows = driver.find_elements(By.CSS_SELECTOR, "#lost-table tbody tr.lost-row")
    return [(r.get_attribute("data-variant"), r.get_attribute("data-sample")) for r in rows if r.is_displayed()]


def check_report(driver, page: Path, verdict: str, variants: int, lost: set[tuple[str, str]]) -> list[str]:
    """Everything wrong with a report page as a reader sees it (an empty list: nothing)."""
    problems = [f"console: {e}" for e in open_page(driver, page, "tradeoff-plot")]
    status = driver.find_element(By.ID, "verdict-status")
    if not status.is_displayed() or status.text != verdict:
        problems.append(f"verdict: the page shows {status.text!r}, the gate says {verdict!r}")
    drawn = len(driver.find_elements(By.CSS_SELECTOR, "#tradeoff-plot .scatterlayer .trace .points path.point"))
    if drawn != variants:
        problems.append(f"trade-off: {drawn} markers drawn for {variants} variants")
    if not driver.find_element(By.ID, "lost-table").is_displayed() or set(shown_rows(driver)) != lost:
        problems.append(f"lost samples: the table shows {sorted(shown_rows(driver))}, the records {sorted(lost)}")
    width = driver.execute_script("return [document.documentElement.scrollWidth, window.innerWidth]")
    if width[0] > width[1]:
        problems.append(f"the page overflows sideways: {width[0]} px wide in a {width[1]} px window")
    choose = Select(driver.find_element(By.ID, "filter-variant"))
    for variant in sorted({v for v, _ in lost}):
        choose.select_by_value(variant)
        shown, want = sorted(shown_rows(driver)), sorted(x for x in lost if x[0] == variant)
        if shown != want:
            problems.append(f"filter {variant}: the table shows {shown}, the records {want}")
        count = driver.find_element(By.ID, "lost-count").text
        if count != str(len(want)):
            problems.append(f"filter {variant}: the count says {count}, {len(want)} rows match")
    choose.select_by_value("")
    return problems + [f"console: {e}" for e in console_errors(driver)]


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]


def lost_in(runs: list[Path]) -> set[tuple[str, str]]:
    """(label, sample id) of every row scoring below its run's baseline row on the same sample, read from the files;
    the labels are the task-prefixed ones that runs of several tasks get (README, Comparing runs)."""
    out = set()
    for run in runs:
        rows = records(run)
        base = {r["sample_id"]: r["score"] for r in rows if r["variant"] == "baseline"}
        out |= {(f"{r['task']}/{r['variant']}", r["sample_id"]) for r in rows if r["score"] < base[r["sample_id"]]}
    return out


@pytest.fixture(scope="module")
def report_page(report_runs, tmp_path_factory) -> tuple[Path, str, int, set]:
    """The report of the three real runs (three tasks) as the CLI writes it, after the gate judged them (the report
    shows the gate's verdict.json, which it finds beside the first run's rows). Copies of the runs: the gate records
    its look in the folders it judges, and the runs are shared with other tests."""
    out = tmp_path_factory.mktemp("report")
    runs = [shutil.copytree(report_runs[name], out / name) for name in ("lcc", "needle", "ruler")]
    gate = [sys.executable, "-m", "evalkit.gate", *map(str, runs)]
    subprocess.run(gate, cwd=ROOT, capture_output=True, text=True, timeout=300)
    verdict = json.loads((runs[0] / "verdict.json").read_text())["verdict"]
    cmd = [sys.executable, "-m", "evalkit.report", *map(str, runs), "--out", str(out / "page")]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    variants = sum(len({r["variant"] for r in records(run)}) for run in runs)
    lost = lost_in(runs)
    assert {v for v, _ in lost} == {"hf/streaming_llm@0.25", "hf/snapkv@0.5"}, lost  # the graded run loses samples
    return out / "page" / "report.html", verdict, variants, lost


def test_the_report_of_three_tasks_reads_right_in_chromium(browser, report_page):
    """No console error; the gate's verdict on top; one trade-off marker per variant of the three runs; the lost
    samples table holds exactly the rows below their baseline, and filtering by a variant shows exactly its rows;
    nothing overflows sideways at 1280 px."""
    page, verdict, variants, lost = report_page
    assert check_report(browser, page, verdict, variants, lost) == []


def test_the_plan_page_draws_its_pressure_plot_in_chromium(browser, tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "evalkit.plan", "model=tiny-random", f"plan.out={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert open_page(browser, tmp_path / "plan.html", "pressure-plot") == []
    doc = json.loads((tmp_path / "plan.json").read_text())
    locations = {(p["batch"], p["context"]) for p in doc["pressure"]["points"].values()}
    crossings = [c for c in doc["pressure"]["crossover"].values() if c is not None]
    drawn = browser.find_elements(By.CSS_SELECTOR, "#pressure-plot .scatterlayer .trace .points path.point")
    assert len(drawn) == len(locations) + len(crossings)  # the operating points, and the curve's markers
    assert [h.text for h in browser.find_elements(By.CSS_SELECTOR, "main h2")][:2] == [
        "Model",
        "KV pressure per decode step",
    ]


def test_the_checks_fail_on_a_broken_page(browser, report_page, tmp_path):
    """The same checks on the page broken twice (a script error, and a filter that hides nothing) report both: the
    browser test can fail."""
    page, verdict, variants, lost = report_page
    text = page.read_text()
    assert "row.hidden = !ok;" in text
    broken = text.replace("row.hidden = !ok;", "row.hidden = false;").replace(
        "</body>", "<script>window.undefinedFunction();</script></body>"
    )
    (tmp_path / "report.html").write_text(broken)
    problems = check_report(browser, tmp_path / "report.html", verdict, variants, lost)
    assert any(p.startswith("console:") and "undefinedFunction" in p for p in problems), problems
    assert any(p.startswith("filter hf/snapkv@0.5") for p in problems), problems
    assert any(p.startswith("filter hf/streaming_llm@0.25") for p in problems), problems


# --- the cross-task report that crashed (KeyError: 'context_length', exit 3), from the same three runs ---------------
# (here, beside the browser tests: one worker of `make test` builds the runs once)


def test_a_needle_run_and_an_lm_eval_ruler_run_make_one_report(report_runs, tmp_path):
    """`python -m evalkit.report NEEDLE RULER`: both runs side by side (variants prefixed with their task), n per
    variant as each run's samples.jsonl counts it, a cells panel per run laid out from its own cell keys (needle:
    depth down, context length across; RULER: its max_length), and a panel per run."""
    needle, ruler = report_runs["needle"], report_runs["ruler"]
    res = subprocess.run(
        [sys.executable, "-m", "evalkit.report", str(needle), str(ruler), "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    page = read_page(tmp_path / "report.html")
    counted = {}
    for task, run in (("needle", needle), ("lm_eval", ruler)):
        for line in (run / "samples.jsonl").read_text().splitlines():
            r = json.loads(line)
            counted[task, r["variant"]] = counted.get((task, r["variant"]), 0) + 1
    table = [texts(r) for r in page.tables["variant-table"][1:]]
    shown = {(row[0], row[1]): int(row[3]) for row in table}
    assert shown == {(task, variant): n for (task, variant), n in counted.items()}
    assert "needle" in page.text["cells"] and "lm_eval" in page.text["cells"]
    assert "depth down, context_length across" in page.text["cells"]
    assert "max_length across" in page.text["cells"]
    assert page.text["runs"].count("tiny-random") >= 2 and "niah_single_1" in page.text["runs"]
    assert "Trade-off" in page.text["tradeoff"] and page.figures["tradeoff-plot"]["data"]


# --- a budget search's safe frontier (issue 51) -------------------------------------------------------------------

SEARCH_GATE = "name: wide\nmin_baseline_accuracy: null\nmin_cell_accuracy: null\nmin_samples: 1\nmax_drop: 0.5\n"


def test_a_budget_searchs_frontier_reads_right_in_chromium(browser, tmp_path):
    """A tiny-random search of two policies at two budgets, gated and reported: the frontier draws a marker per
    budget searched plus the safe budget's star and the first budget not shown safe's cross, as verdict.json says;
    each policy's statement is on the page as the gate wrote it, with the procedure; no console error."""
    run, gate = tmp_path / "run", tmp_path / "wide.yaml"
    gate.write_text(SEARCH_GATE)
    res = subprocess.run(
        [sys.executable, "-m", "evalkit", "model=tiny-random", "task.context_lengths=[256]", "task.depths=[0.5]",
         "search.budgets=[0.75,0.35]", "search.policies=[snapkv,streaming_llm]", "task.max_new_tokens=4",
         "task.samples_per_cell=4", "gate=none", f"hydra.run.dir={run}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    judged = subprocess.run([sys.executable, "-m", "evalkit.gate", str(run), "--gate", str(gate)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert judged.returncode in (0, 1, 2), judged.stderr[-2000:]
    search = json.loads((run / "verdict.json").read_text())["search"]
    res = subprocess.run([sys.executable, "-m", "evalkit.report", str(run), "--out", str(tmp_path / "page")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert open_page(browser, tmp_path / "page" / "report.html", "frontier-plot") == []
    policies = search["policies"].values()
    want = sum(len(p["steps"]) + (p["safe_variant"] is not None) + (p["first_not_safe"] is not None) for p in policies)
    drawn = browser.find_elements(By.CSS_SELECTOR, "#frontier-plot .scatterlayer .trace .points path.point")
    assert len(drawn) == want
    shown = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#search-statements .statement")]
    assert shown == [p["statement"] for p in policies]
    assert search["procedure"] in browser.find_element(By.ID, "search").text
    assert console_errors(browser) == []
