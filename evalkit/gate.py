"""The validation gate: thresholds on the paired results of one or more runs -> PASS, FAIL, INCONCLUSIVE or
CANNOT JUDGE.

    python -m evalkit.gate results/RUN [results/RUN2 ...] [--gate conf/gate/default.yaml] [--out DIR]
    python -m evalkit.gate --plan [--gate default] [--variants 3] [--cells 10]   # the samples a PASS needs
    python -m evalkit gate=default policy=snapkv task=needle          # run, then gate

Exit code 0 PASS, 1 FAIL, 2 INCONCLUSIVE or cannot judge (or a usage error). PASS: every threshold is shown to hold
at the gate's one-sided confidence (evalkit.decide). FAIL: a threshold is shown broken, compression was asked but
not achieved, or runs whose model weights, protocol or library versions differ. INCONCLUSIVE: neither, with the
samples that would settle it. CANNOT JUDGE, never a PASS: records that cannot support a verdict (torn, corrupt or
repeated rows, several runs in one file, no policy rows, a variant not run on the baseline's samples, a missing
run.json, a baseline too weak for the task). Writes verdict.json and report.md either way.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from evalkit import looks
from evalkit.analysis import BASELINE, chunked_vs_oneshot, is_baseline, merge, summarize
from evalkit.cli import guarded
from evalkit.contexts import GRADED_FLIP_DELTA
from evalkit.decide import (
    SHOWN_TO_FAIL,
    cell_decisions,
    decision_summary,
    floor,
    look_record,
    unjudged_cells,
    variant_decisions,
)
from evalkit.errors import EXIT_FAIL, EXIT_OK, CannotJudge, ConfigError
from evalkit.evidence import contradictions, row_problem, run_problems
from evalkit.plan import capacity
from evalkit.power import plan
from evalkit.records import RUN, SAMPLES, scan_rows, torn_line, write_atomic
from evalkit.stats import MULTIPLICITY
from evalkit.units import fmt_bytes

VERDICT, REPORT = "verdict.json", "report.md"


@dataclass
class Thresholds:
    """Conf/gate/*.yaml. None switches a check off."""

    max_drop: float | None = 0.05  # non-inferiority margin on the accuracy drop, shown by its upper bound
    confidence: float = 0.95  # one-sided, of every bound and test
    multiplicity: str = "holm"  # holm, bonferroni or none: across variants, and across cells
    max_flip_rate: float | None = 0.10  # lost samples / samples, shown below it for a PASS
    min_cell_accuracy: float | None = 0.5  # per cell, where the baseline reaches it: a FAIL when shown below it
    min_baseline_accuracy: float | None = 0.5  # below it overall: cannot judge; cells below it are not judged
    max_mean_kl: float | None = 0.1  # nats, fidelity rows: the mean of each row's KL capped at 10x this, shown below it
    min_samples: int | None = None  # contexts; None: the fewest a lossless PASS needs (evalkit.decide.min_samples)
    graded_flip_delta: float = GRADED_FLIP_DELTA  # a graded score counts as lost when it falls by more than this
    min_compression: float = 0.99  # a compressing variant must hold less than this share of the baseline's bytes
    capacity: dict[str, float] = field(default_factory=lambda: {"gpu_gib": 80, "context": 32768})  # report only


@dataclass
class Verdict:
    status: str  # PASS, FAIL, INCONCLUSIVE (not shown either way: more samples) or CANNOT JUDGE (the records)
    reasons: list[str] = field(default_factory=list)  # why it FAILs, is INCONCLUSIVE, or cannot be judged
    variants: dict[str, Any] = field(default_factory=dict)
    runs: list[str] = field(default_factory=list)
    capacity: dict[str, Any] = field(default_factory=dict)
    chunked: list[dict[str, Any]] = field(default_factory=list)  # chunked vs one-shot prefill, side by side
    not_judged: list[str] = field(default_factory=list)  # cells left out: the baseline is too weak there
    cells: list[dict[str, Any]] = field(default_factory=list)  # per variant and cell: n, flips, bounds, status
    advice: str | None = None  # INCONCLUSIVE: the samples that would settle it
    extend: str | None = None  # INCONCLUSIVE, one run: the command that adds them, in the run's own folder
    look: dict[str, Any] = field(default_factory=dict)  # this judgement's record for run.json (evalkit.looks)
    history: looks.History = field(default_factory=looks.History)

    @property
    def passed(self) -> bool:
        return self.status == "PASS"


@dataclass
class Records:
    """The rows of one or more runs, merged (see analysis.merge), and why they cannot be judged, if they cannot."""

    rows: list[dict]  # the rows that could be read, each (sample, variant) once
    infos: list[dict]  # the run.json of every run that has a readable one
    problems: list[str] = field(default_factory=list)  # each names the file (and line) and the fix


def load_thresholds(name_or_path: str) -> Thresholds:
    path = Path(name_or_path)
    if not path.suffix:
        path = Path(str(files("evalkit.conf") / "gate" / f"{name_or_path}.yaml"))
    if not path.is_file():
        raise ConfigError(f"gate {name_or_path!r}: no such gate config (conf/gate/<name>.yaml or a YAML path)")
    try:
        node = OmegaConf.load(path)
    except Exception as err:  # noqa: BLE001 - YAML or OmegaConf errors: a file the user wrote
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"gate {name_or_path!r}: {path} is not valid YAML ({first}); fix the file") from None
    return thresholds(node, repr(name_or_path))


# Each threshold: the types it takes, its range as (low, high, low included, high included), and an example. None
# (null in YAML) switches a check off where the field allows it (Thresholds).
RANGES: dict[str, tuple[tuple[type, ...], tuple[float, float, bool, bool], str]] = {
    "max_drop": ((int, float), (0, 1, True, True), "0.05"),
    "confidence": ((float,), (0.5, 1, False, False), "0.95"),
    "max_flip_rate": ((int, float), (0, 1, True, True), "0.10"),
    "min_cell_accuracy": ((int, float), (0, 1, True, True), "0.5"),
    "min_baseline_accuracy": ((int, float), (0, 1, True, True), "0.5"),
    "max_mean_kl": ((int, float), (0, math.inf, True, False), "0.1"),
    "min_samples": ((int,), (1, math.inf, True, False), "59"),
    "min_compression": ((int, float), (0, 1, False, True), "0.99"),
    "graded_flip_delta": ((int, float), (0, 1, True, False), "0.1"),  # a graded score falling by more is lost
}
NULLABLE = {"max_drop", "max_flip_rate", "min_cell_accuracy", "min_baseline_accuracy", "max_mean_kl", "min_samples"}


def _in_range(value: float, lo: float, hi: float, lo_in: bool, hi_in: bool) -> bool:
    return (lo <= value if lo_in else lo < value) and (value <= hi if hi_in else value < hi)


def _interval(lo: float, hi: float, lo_in: bool, hi_in: bool) -> str:
    return f"{'[' if lo_in else '('}{lo:g}, {hi:g}{']' if hi_in else ')'}"


def check_threshold(key: str, value: Any) -> None:
    """ConfigError unless `value` has the type and lies in the range `key` takes (RANGES)."""
    kinds, bounds, example = RANGES[key]
    if value is None and key in NULLABLE:
        return
    off = ", or null to switch the check off" if key in NULLABLE else ""
    number = isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value)
    if not number or not _in_range(value, *bounds):
        what = "a whole number" if kinds == (int,) else "a number"
        raise ConfigError(f"gate.{key}={value!r}: give {what} in {_interval(*bounds)}, e.g. {example}{off}")


def thresholds(node, where: str) -> Thresholds:
    """Thresholds from a gate config (conf/gate/*.yaml, or the run's `gate` node); `where` names it in errors. Every
    threshold is typed and ranged (RANGES); a gate left with no accuracy check is refused."""
    if not isinstance(node, (dict, DictConfig)):
        kind = "a list" if isinstance(node, (list, ListConfig)) else type(node).__name__
        raise ConfigError(f"gate {where} is {kind}, not a mapping of thresholds (max_drop: 0.05, ...); fix its YAML")
    cfg = {k: v for k, v in OmegaConf.to_container(OmegaConf.create(node), resolve=True).items() if k != "name"}
    unknown = set(cfg) - set(Thresholds.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"gate {where}: unknown thresholds {sorted(unknown)}")
    t = Thresholds(**cfg)
    for key in RANGES:
        check_threshold(key, getattr(t, key))
    if t.multiplicity not in MULTIPLICITY:
        raise ConfigError(f"gate.multiplicity={t.multiplicity!r} is not one of {list(MULTIPLICITY)}")
    cap = t.capacity
    if not isinstance(cap, dict) or set(cap) != {"gpu_gib", "context"} or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in cap.values()
    ):
        raise ConfigError(f"gate.capacity={cap!r}: give {{gpu_gib: 80, context: 32768}}, both numbers > 0")
    if t.max_drop is None and t.max_flip_rate is None:
        raise ConfigError(
            f"gate {where}: max_drop and max_flip_rate are both null, so no check could show the policy keeps the "
            "baseline's accuracy and any variant would PASS; set at least one, e.g. max_drop: 0.05"
        )
    return t


# What the gate reads from every row, and must be numbers
ROW_FIELDS = (
    "sample_id",
    "variant",
    "score",
    "baseline_score",
    "cell",
    "kv_bytes",
    "kv_bytes_baseline",
    "peak_kv_bytes",
)
LISTED = 3  # bad lines named per file; the rest are counted


def read_runs(run_dirs: list[Path]) -> Records:
    """All rows and run.json files under the given folders (a Hydra multirun folder holds several runs), the rows
    merged into one table with variant labels that keep different measurements apart (see analysis.merge), and every
    reason, file by file, why they cannot be judged."""
    runs, infos, problems = [], [], []
    for d in run_dirs:
        found = [d] if (d / SAMPLES).exists() else sorted(p.parent for p in d.rglob(SAMPLES))
        if not found:
            raise ConfigError(f"{d}: no {SAMPLES} found; give an evalkit run folder (results/...)")
        for run in found:
            info, problem = read_info(run / RUN)
            problem = problem or next(iter(run_problems(info, str(run / RUN))), None)
            if problem:
                problems.append(problem)
            else:
                infos.append({**info, "_folder": str(run.resolve())})  # in memory only: the folder the advice extends
            rows, lines, bad = read_records(run / SAMPLES)
            where = str(run / SAMPLES)
            problems += bad or check_rows(rows, where, info.get("run_id")) or contradictions(rows, lines, where)
            runs.append((run.resolve(), info, _once(rows)))
    return Records(merge(runs), infos, problems)


def read_info(path: Path) -> tuple[dict, str | None]:
    """A run's run.json, or ({}, why it cannot be used)."""
    fix = (
        "the gate needs the run.json its run wrote beside the rows (config, model, versions): judge the folder the "
        "run wrote, or rerun it"
    )
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}, f"{path}: missing; {fix}"
    except (OSError, UnicodeDecodeError) as err:
        return {}, f"{path}: cannot be read ({getattr(err, 'strerror', None) or err}); fix its permissions, or {fix}"
    if not text.strip():
        return {}, f"{path}: empty (a write was killed?); {fix}"
    try:
        info = json.loads(text)
    except json.JSONDecodeError as err:
        return {}, f"{path}: not valid JSON ({err.msg}, line {err.lineno}); {fix}"
    if not isinstance(info, dict):
        return {}, f"{path}: not a JSON object; {fix}"
    return info, None


def read_records(path: Path) -> tuple[list[dict], list[int], list[str]]:
    """The rows of a samples.jsonl that the gate can read, the line of each, and a problem for every line it cannot
    (torn included; a row whose scores or bytes are not finite numbers in range, evalkit.evidence.row_problem)."""
    try:
        rows, bad, torn, _, lines = scan_rows(path, ROW_FIELDS, row_problem)
    except ConfigError as err:
        return [], [], [str(err)]
    if len(bad) > LISTED:
        bad = [*bad[:LISTED], f"{path}: {_n(len(bad) - LISTED, 'more line')} like these"]
    return rows, lines, bad + ([torn_line(path, torn)] if torn is not None else [])


def _once(rows: list[dict]) -> list[dict]:
    """The first row of every (sample, variant)."""
    first: dict[tuple, dict] = {}
    for r in rows:
        first.setdefault((r["sample_id"], r["variant"]), r)
    return list(first.values())


def _n(k: int, noun: str) -> str:
    return f"{k} {noun}" + ("" if k == 1 else "s")


def _some(values, k: int = 3) -> str:
    values = sorted(map(str, values))
    return ", ".join(values[:k]) + (f" and {len(values) - k} more" if len(values) > k else "")


def check_rows(rows: list[dict], where: str, run_id: str | None = None) -> list[str]:
    """Why the rows of one records file (one run) cannot be judged: none, repeated (sample, variant) rows, rows of
    several runs or configurations, no baseline or no policy rows, a variant not run on the baseline's samples."""
    if not rows:
        return [f"{where}: no rows; the run wrote none: finish it with resume=true, or give a finished run's folder"]
    out = []
    first: dict[tuple, int] = {}
    repeats = []
    for i, r in enumerate(rows, start=1):
        key = (r["sample_id"], r["variant"])
        if key in first:
            repeats.append((key, first[key], i))
        else:
            first[key] = i
    if repeats:
        (sid, variant), a, b = repeats[0]
        verb = "repeats" if len(repeats) == 1 else "repeat"
        out.append(
            f"{where}: {_n(len(repeats), 'row')} {verb} a (sample, variant) already recorded (first: sample {sid!r}, "
            f"variant {variant!r}, lines {a} and {b}): rows were written twice (a run's rows appended to its own "
            "file?); keep one row per sample and variant, or rerun into a new folder"
        )
    ids = {str(r["run_id"]) for r in rows if r.get("run_id") is not None}
    if len(ids) > 1:
        out.append(
            f"{where}: rows of {len(ids)} runs in one file (run ids {_some(ids)}): several runs wrote the same "
            "folder; give each run its own folder (hydra.run.dir=...) and rerun them"
        )
    else:
        if ids and run_id is not None and ids != {str(run_id)}:
            out.append(
                f"{where}: the rows were written by run {ids.pop()}, but the run.json beside them is run {run_id}'s: "
                "several runs wrote the same folder; give each run its own folder (hydra.run.dir=...) and rerun"
            )
        settings: dict[str, set[str]] = defaultdict(set)
        for r in rows:
            settings[r["variant"]].add(
                json.dumps([r.get(k) for k in ("task", "protocol", "policy", "quant", "prefill")], sort_keys=True)
            )
        mixed = sorted(v for v, s in settings.items() if len(s) > 1)
        if mixed:
            out.append(
                f"{where}: variants {_some(mixed)} recorded with different settings (task, protocol, policy, quant "
                "or prefill) in one file: rows of several configurations; give each run its own folder and rerun them"
            )
    samples: dict[str, set] = defaultdict(set)
    for r in rows:
        samples[r["variant"]].add(r["sample_id"])
    base = set().union(*(ids for v, ids in samples.items() if is_baseline(v)))
    policies = sorted(v for v in samples if not is_baseline(v))
    if not policies:
        out.append(
            f"{where}: only baseline rows ({_n(len(base), 'sample')}), no policy rows: nothing to judge; run a policy "
            "(policy=... or variants=[...]), or finish the run with resume=true"
        )
    elif not base:
        out.append(
            f"{where}: no baseline rows: every variant must be compared with the full cache on the same samples; "
            "rerun with evalkit, which runs the baseline on every sample"
        )
    else:
        for v in policies:
            missing, extra = base - samples[v], samples[v] - base
            parts = (
                [f"lacks {len(missing)} of the baseline's {_n(len(base), 'sample')} ({_some(missing)})"]
                if missing
                else []
            )
            parts += [f"has {_n(len(extra), 'sample')} the baseline lacks ({_some(extra)})"] if extra else []
            if parts:
                out.append(
                    f"{where}: variant {v!r} {' and '.join(parts)}: it was not run on the baseline's samples; finish "
                    "the run with resume=true, or rerun it"
                )
    return out


def _compression_asked(row: dict) -> bool:
    policy = row.get("policy") or {}
    return bool(row.get("quant")) or (
        policy.get("name") not in (None, "none", BASELINE) and policy.get("budget") != 1.0
    )


def baseline_problems(summary: dict[str, Any], t: Thresholds) -> tuple[list[str], list[str]]:
    """A baseline below min_baseline_accuracy (cannot judge), and the cells where it is (not judged)."""
    if t.min_baseline_accuracy is None:
        return [], []
    problems, cells = [], []
    for name, s in summary.items():
        if not is_baseline(name):
            continue
        of = "" if name == BASELINE else f" ({name})"
        if s["accuracy"] < t.min_baseline_accuracy:
            problems.append(
                f"the full-cache baseline{of} scores {s['accuracy']:.2f} on this task (gate.min_baseline_accuracy is "
                f"{t.min_baseline_accuracy}): nothing can be learned about the policy; use a stronger model or an "
                "easier task"
            )
            continue
        cells += [
            f"cell {cell}{of}: the baseline scores {c['baseline']:.2f} there, below {t.min_baseline_accuracy}"
            for cell, c in s["cells"].items()
            if c["baseline"] < t.min_baseline_accuracy
        ]
    return problems, cells


def judge(rows: list[dict], infos: list[dict], t: Thresholds, problems: list[str] | None = None) -> Verdict:
    """Every reason a variant fails, in words; PASS only when there is none. `problems`: why the records cannot be
    judged, found while reading them (read_runs); None checks `rows` here, as the rows of one records file."""
    reasons: list[str] = []
    for key, what in (("protocol", "protocol"), ("versions", "library versions")):
        seen = {json.dumps(_field(i, key), sort_keys=True) for i in infos}
        if len(seen) > 1:
            reasons.append(f"the runs differ in {what} ({len(seen)} different); gate runs of one configuration")
    for name in sorted({(i.get("model") or {}).get("name") for i in infos} - {None}):
        prints = {_field(i, "model") for i in infos if (i.get("model") or {}).get("name") == name}
        if len(prints) > 1:
            reasons.append(f"the runs of model {name} used different weights ({len(prints)} fingerprints)")
    cannot = check_rows(rows, "the records") if problems is None else list(problems)
    if not rows and not cannot:
        cannot.append("no records")
    summary = summarize(rows) if rows else {}
    weak, not_judged = baseline_problems(summary, t)
    # capacity is a figure per model: with several, each is counted against the largest model's weights
    weights = max((_field(i, "weights") or 0 for i in infos), default=0)
    cap = capacity(summary, weights, float(t.capacity["gpu_gib"]), int(t.capacity["context"]))
    if cannot or weak:
        chunked = chunked_vs_oneshot(rows) if rows else []
        return Verdict("CANNOT JUDGE", [*cannot, *weak, *reasons], summary, capacity=cap, chunked=chunked)
    by_variant: dict[str, list[dict]] = {}
    for r in rows:
        by_variant.setdefault(r["variant"], []).append(r)
    policies = {name: by_variant[name] for name in summary if not is_baseline(name)}
    key = looks.digest(rows, t)
    history = looks.history(infos, key)
    decisions = variant_decisions(policies, t, history)
    cells = cell_decisions(policies, t, history)
    inconclusive: list[str] = []
    for name, s in summary.items():
        if is_baseline(name):
            continue
        d = decisions[name]
        s["gate"] = decision_summary(d, t)
        note = unjudged_cells(cells, name, t)
        not_judged += [note] if note else []
        reasons += d.fail
        inconclusive += d.open
        reasons += [
            f"{name}: cell {c.cell}: accuracy {c.policy:.2f} (baseline {c.baseline:.2f}, n={c.n}) shown below "
            f"{t.min_cell_accuracy} at {t.confidence:.0%} ({t.multiplicity} over the cells judged)"
            for c in cells
            if c.variant == name and c.status == SHOWN_TO_FAIL
        ]
        over = [
            r
            for r in by_variant[name]
            if r.get("prefill_bound_tokens") is not None and r["prefill_peak_tokens"] > r["prefill_bound_tokens"]
        ]
        if over:
            r = max(over, key=lambda r: r["prefill_peak_tokens"])
            reasons.append(
                f"{name}: the chunked prefill held {r['prefill_peak_tokens']} tokens in a layer, over its bound of "
                f"{r['prefill_bound_tokens']} (budget + chunk), on {len(over)} samples"
            )
        if any(_compression_asked(r) for r in by_variant[name]) and s["kv_ratio"] >= t.min_compression:
            clipped = s.get("budget_clipped")
            reasons.append(
                f"{name}: compression was asked but its KV bytes are {s['kv_ratio']:.3f}x the full cache's "
                f"({s['kv_ratio_basis']})"
                + (
                    f" (its budget exceeds the context of {clipped} of {s['n']} samples: budget_clipped)"
                    if clipped
                    else ""
                )
            )
    status = "FAIL" if reasons else "INCONCLUSIVE" if inconclusive else "PASS"
    advice, extend = _advice(decisions, summary, infos, cells) if status == "INCONCLUSIVE" else (None, None)
    return Verdict(
        status,
        reasons + inconclusive,
        summary,
        capacity=cap,
        chunked=chunked_vs_oneshot(rows),
        not_judged=not_judged,
        cells=[asdict(c) for c in cells],
        advice=advice,
        extend=extend,
        look=looks.entry(history, key, status, t, look_record(decisions, cells)),
        history=history,
    )


def _advice(
    decisions: dict[str, Any], summary: dict[str, Any], infos: list[dict], cells: list
) -> tuple[str, str | None]:
    """How many samples would settle an INCONCLUSIVE verdict, in the task's own terms where one run is judged, and
    the command that adds them to that run (extend_command; None where there is none)."""
    needs = {name: d.samples_needed for name, d in decisions.items() if d.status == "INCONCLUSIVE"}
    if any(v is None for v in needs.values()):
        return (
            "more samples may settle it (graded scores, or an observed drop or flip rate at the limit: no count "
            "follows from the observed rates)"
        ), None
    name = max(needs, key=lambda k: needs[k] - summary[k]["n"])
    need, have = needs[name], summary[name]["n"]
    d = decisions[name]
    unit = "samples" if d.evidence.contexts.single else f"samples ({d.contexts_needed} contexts, the unit counted)"
    text = (
        f"at the observed rates, {need} {unit} would show it with about 80% chance at look {d.look + 1} (judged by "
        f"the anytime-valid betting test): add at least {need - have}"
    )
    task = ((infos[0].get("config") or {}).get("task") or {}) if len(infos) == 1 else {}
    n_cells = len({c.cell for c in cells if c.variant == name}) or 1
    if "samples_per_cell" in task:
        setting = f"task.samples_per_cell={math.ceil(need / n_cells)}"
    elif "limit" in task:
        setting = f"task.limit={need}"
    else:
        return text, None
    return f"{text}, e.g. {setting} resume=true", extend_command(infos[0], setting)


RUNNERS = ("__main__.py", "evalkit")  # `python -m evalkit` and the `evalkit` script: what writes a run's command


def extend_command(info: dict, setting: str) -> str | None:
    """The command that extends a run in its own folder: the one that wrote it (run.json `command`), with `setting`
    (`task.limit=59`) in place of its own, resume=true and hydra.run.dir naming the folder. None where the run was
    not written by `python -m evalkit` (lm-eval's command line)."""
    argv, folder = info.get("command"), info.get("_folder")
    if not isinstance(argv, list) or not argv or folder is None or Path(str(argv[0])).name not in RUNNERS:
        return None
    key = setting.split("=", 1)[0]
    drop = (key, "resume", "hydra.run.dir")
    args = [str(a) for a in argv[1:] if str(a).lstrip("+~").split("=", 1)[0] not in drop]
    args += [setting, "resume=true", f"hydra.run.dir={folder}"]
    return "python -m evalkit " + " ".join(shlex.quote(a) for a in args)


def _field(info: dict, key: str) -> Any:
    if key == "model":
        return (info.get("model") or {}).get("fingerprint")
    if key == "weights":
        return (info.get("model") or {}).get("weights_bytes")
    if key == "versions":
        return {k: v for k, v in (info.get("versions") or {}).items() if k in ("torch", "transformers", "evalkit")}
    return info.get(key)


def output_folder(out: Path) -> Path:
    """`out`, created if missing; a ConfigError when it is a file or cannot be created."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file, not a folder: give --out a folder (it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create {out} ({err.strerror or err}); give --out a writable folder") from None
    return out


def write_text(path: Path, text: str) -> None:
    """Write a gate output atomically (records.write_atomic), or a ConfigError naming it."""
    try:
        write_atomic(path, text)
    except OSError as err:
        raise ConfigError(f"could not write {path} ({err.strerror or err}); give --out a writable folder") from None


def verdict_doc(verdict: Verdict, t: Thresholds) -> dict[str, Any]:
    """verdict.json: what the gate decided, why, at which thresholds and look, and the command that extends an
    INCONCLUSIVE run (the report shows the same document)."""
    return {
        "verdict": verdict.status,
        "reasons": verdict.reasons,
        "not_judged": verdict.not_judged,
        "advice": verdict.advice,
        "extend": verdict.extend,
        "cells": verdict.cells,
        "thresholds": asdict(t),
        "runs": verdict.runs,
        "variants": verdict.variants,
        "chunked_vs_oneshot": verdict.chunked,
        "look": verdict.look,
    }


def write_outputs(verdict: Verdict, out_dir: Path, t: Thresholds) -> None:
    output_folder(out_dir)
    write_text(out_dir / VERDICT, json.dumps(verdict_doc(verdict, t), indent=2, sort_keys=True) + "\n")
    lines = [f"# evalkit gate: {verdict.status}", ""]
    if verdict.status == "CANNOT JUDGE":
        lines += ["These records cannot be judged (exit code 2); the tables below, if any, are not a verdict.", ""]
    if verdict.status == "INCONCLUSIVE":
        lines += [
            "Neither shown within the thresholds nor shown outside them at the gate's confidence (exit code 2): "
            + (verdict.advice or "more samples would settle it")
            + ".",
            "",
            *([f"To extend the run: `{verdict.extend}`", ""] if verdict.extend else []),
        ]
    lines += [f"- {r}" for r in verdict.reasons] or [
        f"Every threshold is shown to hold at {t.confidence:.0%} one-sided confidence ({t.multiplicity} across "
        f"variants), at look {verdict.look.get('look', 1)} of this run (the confidence holds over all its looks)."
    ]
    if verdict.not_judged:
        lines += [
            "",
            "Not judged: cells where the full-cache baseline is below min_baseline_accuracy, a cell criterion that "
            "could judge no cell, a look that could not be recorded.",
            "",
        ]
        lines += [f"- not judged: {c}" for c in verdict.not_judged]
    if verdict.variants:
        lines += tables(verdict, t)
    if verdict.cells:
        lines += cell_table(verdict.cells, t)
    lines += ["", "Thresholds: " + ", ".join(f"{k}={v}" for k, v in asdict(t).items()), ""]
    write_text(out_dir / REPORT, "\n".join(lines))


def tables(verdict: Verdict, t: Thresholds) -> list[str]:
    lines = [
        "",
        f"Drop bounds: the gate's, one-sided {t.confidence:.0%} each, counted in contexts (method per row: the exact "
        "first look, or the anytime-valid betting test at a later look or with several questions per context); status "
        f"after {t.multiplicity} across variants, with the look that reached it.",
        "",
        "KV ratio: the variant's KV bytes over the full cache's, both as a deployment holds them (dense in fp16/bf16, "
        "quantized packed); KV measured: bytes held here, in the model's own dtype.",
        "",
        "| variant | status | n | baseline | policy | drop [bounds] | method | McNemar p | lost | gained | KV ratio "
        "(fp16) | KV measured |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name, s in verdict.variants.items():
        p, g = s["paired"], s.get("gate") or {}
        drop = (g.get("checks") or {}).get("drop") or {"bounds": p["drop_bounds"], "method": p["method"]}
        lo, hi = drop["bounds"]
        status = f"{g['status']} (look {g['look']})" if g else "-"
        n = s["n"] if not g or g["contexts"] == s["n"] else f"{s['n']} ({g['contexts']} contexts)"
        lines.append(
            f"| {name} | {status} | {n} | {p['baseline']:.2f} | {p['policy']:.2f} | {p['drop']:+.3f} "
            f"[{lo:+.3f}, {hi:+.3f}] | {drop['method']} | {p['mcnemar_p']:.3g} | {s['lost']} | {s['gained']} | "
            f"{s['kv_ratio']:.3f}x | {fmt_bytes(s['kv_bytes'], 'MiB')} ({s['kv_ratio_measured']:.3f}x) |"
        )
    gib, ctx = t.capacity["gpu_gib"], t.capacity["context"]
    lines += [
        "",
        f"Capacity: sequences of {ctx} tokens that fit in {gib} GiB after the weights, from the KV bytes",
        "per context token as a deployment holds them (fp16/bf16 dense, packed quantized).",
        "",
        "| variant | KV bytes per token | sequences | nominal budget | KV ratio (fp16) | peak KV measured (prefill) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, c in verdict.capacity.items():
        s = verdict.variants[name]
        nominal = "-" if s["nominal_budget"] is None else f"{s['nominal_budget']:g}"
        lines.append(
            f"| {name} | {c['kv_bytes_per_token']:.0f} | {c['sequences']} | {nominal} | "
            f"{s['kv_ratio']:.3f}x | {fmt_bytes(s['peak_prefill_kv_bytes'], 'MiB', 1)} |"
        )
    return lines + chunked_table(verdict.chunked)


def chunked_table(comparisons: list[dict[str, Any]]) -> list[str]:
    """Markdown: each chunked variant beside its one-shot twin (empty when the runs hold none)."""
    if not comparisons:
        return []
    lines = [
        "",
        "Chunked vs one-shot prefill, paired on the same samples (difference = chunked - one-shot).",
        "",
        "| variant | chunk | n | baseline | one-shot | chunked | difference [95% bounds] | chunked lost/gained | "
        "peak KV one-shot | peak KV chunked | peak tokens chunked |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in comparisons:
        lo, hi = c["difference_bounds"]
        lines.append(
            f"| {c['variant']} | {c['chunk']} | {c['n']} | {c['baseline']:.2f} | {c['oneshot']:.2f} | "
            f"{c['chunked']:.2f} | {c['difference']:+.3f} [{lo:+.3f}, {hi:+.3f}] | {c['chunked_lost']}/"
            f"{c['chunked_gained']} | {fmt_bytes(c['oneshot_peak_kv_bytes'], 'MiB')} | "
            f"{fmt_bytes(c['chunked_peak_kv_bytes'], 'MiB')} | {c['chunked_peak_tokens']} |"
        )
    return lines


def cell_table(cells: list[dict[str, Any]], t: Thresholds) -> list[str]:
    """Markdown: every variant's cells with n, flips, the bounds on the cell's drop and the cell's status."""
    lines = [
        "",
        f"Cells: a cell fails when its accuracy is shown below min_cell_accuracy={t.min_cell_accuracy} at "
        f"{t.confidence:.0%} ({t.multiplicity} across the cells judged); drop bounds one-sided {t.confidence:.0%}.",
        "",
        "| variant | cell | n | baseline | policy | lost | gained | drop [bounds] | status |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in cells:
        lo, hi = c["bounds"]
        lines.append(
            f"| {c['variant']} | {c['cell']} | {c['n']} | {c['baseline']:.2f} | {c['policy']:.2f} | {c['lost']} | "
            f"{c['gained']} | [{lo:+.3f}, {hi:+.3f}] | {c['status']} |"
        )
    return lines


def gate(run_dirs: list[Path], thresholds: Thresholds, out_dir: Path | None = None) -> Verdict:
    """Judge the runs and write verdict.json and report.md into `out_dir` (default: the first run folder); return a
    PASS or FAIL verdict for the caller to print. INCONCLUSIVE, or records that cannot be judged: the outputs are
    written (where the folder is writable), the reasons printed (print_verdict), then CannotJudge is raised (exit
    code 2) with the samples that would settle it, or what is wrong with the records."""
    records = read_runs(run_dirs)
    verdict = judge(records.rows, records.infos, thresholds, records.problems)
    verdict.runs = [str(d) for d in run_dirs]
    if verdict.status != "CANNOT JUDGE":
        folders = [Path(info["_folder"]) for info in records.infos]  # the run folders read_runs found
        verdict.not_judged += looks.record(folders, verdict.look, verdict.history)
    out = out_dir or run_dirs[0]
    if verdict.status in ("PASS", "FAIL"):
        write_outputs(verdict, out, thresholds)
        return verdict
    try:
        write_outputs(verdict, out, thresholds)
    except ConfigError as err:
        verdict.reasons.append(f"(verdict.json and report.md not written: {err})")
    print_verdict(verdict)
    if verdict.status == "INCONCLUSIVE":
        raise CannotJudge(f"the gate is INCONCLUSIVE: {verdict.advice}")
    more = len(verdict.reasons) - 1
    raise CannotJudge(
        f"the gate cannot judge these records: {verdict.reasons[0]}" + (f" (and {more} more, above)" if more else "")
    )


def print_verdict(verdict: Verdict) -> None:
    look = verdict.look.get("look")
    print(f"\nevalkit gate: {verdict.status}" + (f" (look {look} of this run)" if look else ""))
    for reason in verdict.reasons:
        print(f"  - {reason}")
    for cell in verdict.not_judged:
        print(f"  - not judged: {cell}")
    if verdict.advice:
        print(f"  - {verdict.advice}")
    if verdict.extend:
        print(f"  - to extend the run: {verdict.extend}")


def _plan(args) -> list[str]:
    """--plan: the samples a PASS needs, for the thresholds and the rates given."""
    if args.variants < 1 or args.cells < 1 or args.questions_per_context < 1:
        raise ConfigError("--variants, --cells and --questions-per-context count things: give whole numbers >= 1")
    if not 0 <= args.icc <= 1:
        raise ConfigError(f"--icc {args.icc}: give a correlation in [0, 1]")
    rates = None
    if args.loss is not None:
        if not (0 <= args.loss <= 1 and 0 <= args.gain <= 1 and args.loss + args.gain <= 1):
            raise ConfigError(f"--loss {args.loss} --gain {args.gain}: give rates in [0, 1] that sum to at most 1")
        rates = [(args.loss, args.gain)]
    t = load_thresholds(args.gate)
    return plan(t, floor(t), args.variants, args.cells, rates, args.questions_per_context, args.icc)


def main(argv: list[str] | None = None) -> int:
    def run() -> int:
        ap = argparse.ArgumentParser(prog="python -m evalkit.gate", description=__doc__.splitlines()[0])
        ap.add_argument("runs", nargs="*", type=Path, help="evalkit run folders (or folders holding several)")
        ap.add_argument("--gate", default="default", help="a conf/gate name or a YAML file of thresholds")
        ap.add_argument("--out", type=Path, help="where verdict.json and report.md go (default: the first run)")
        ap.add_argument("--plan", action="store_true", help="print the samples a PASS needs, and judge nothing")
        ap.add_argument("--variants", type=int, default=1, help="with --plan: variants judged together")
        ap.add_argument("--cells", type=int, default=1, help="with --plan: cells per variant")
        ap.add_argument("--loss", type=float, help="with --plan: the policy's loss rate (right to wrong), e.g. 0.01")
        ap.add_argument("--gain", type=float, default=0.0, help="with --plan: its gain rate (wrong to right)")
        ap.add_argument("--questions-per-context", type=int, default=1, help="with --plan: questions on one context")
        ap.add_argument("--icc", type=float, default=0.5, help="with --plan: correlation of a context's questions")
        args = ap.parse_args(argv)
        if args.plan:
            print("\n".join(_plan(args)))
            return EXIT_OK
        if not args.runs:
            raise ConfigError("give one or more run folders to judge (or --plan to size a run)")
        verdict = gate(args.runs, load_thresholds(args.gate), args.out)
        print_verdict(verdict)
        return EXIT_OK if verdict.passed else EXIT_FAIL

    return guarded(run)


if __name__ == "__main__":
    raise SystemExit(main())
