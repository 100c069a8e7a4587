"""The verdict on records already read: PASS, FAIL, INCONCLUSIVE or CANNOT JUDGE, every reason in words, and for
INCONCLUSIVE the samples that would settle it and the command that adds them."""

from __future__ import annotations

import functools
import json
import math
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from evalkit.capacity import capacity
from evalkit.gate import search
from evalkit.gate.decide import (
    Decision,
    cell_decisions,
    decision_summary,
    look_record,
    unjudged_cells,
    variant_decisions,
)
from evalkit.records import Row, looks
from evalkit.records.evidence import backend_of
from evalkit.records.labels import compression_asked
from evalkit.records.merged import is_baseline, label_order
from evalkit.records.reading import check_rows
from evalkit.records.summary import baseline_problems, chunked_vs_oneshot, summarize
from evalkit.records.verdict import SHOWN_TO_FAIL
from evalkit.thresholds import Thresholds, non_default


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
    look: dict[str, Any] = field(default_factory=dict)  # this judgement's record for looks.jsonl (records.looks)
    history: looks.History = field(default_factory=looks.History)
    digest: str | None = None  # what it judged, rows and thresholds (looks.digest): verdict.json carries it
    partial: list[str] = field(default_factory=list)  # unfinished runs, each said in a line (gate.allow_partial)
    declared: list[str] = field(default_factory=list)  # variants whose KV bytes were declared, never observed
    non_default: list[str] = field(default_factory=list)  # thresholds other than the defaults (thresholds.non_default)
    search: dict[str, Any] | None = None  # a budget search: each policy's safe budget (evalkit.gate.search)

    @property
    def passed(self) -> bool:
        return self.status == "PASS"


def judge(
    rows: list[Row],
    infos: list[dict],
    t: Thresholds,
    problems: list[str] | None = None,
    recorded: looks.Recorded | None = None,
    partial: list[str] | None = None,
) -> Verdict:
    """Every reason a variant fails, in words; PASS only when there is none. `problems`: why the records cannot be
    judged, found while reading them (read_runs); None checks `rows` here, as the rows of one records file.
    `recorded`: the looks the run folders hold (evalkit.records.looks.read), for this look's number and their check.
    `partial`: the runs that are unfinished (read_runs), which never PASS unless gate.allow_partial."""
    recorded = recorded or looks.Recorded()
    reasons = run_reasons(infos)
    cannot = _unjudgeable(rows, problems, recorded)
    key = looks.digest(rows, t)
    summary = summarize(rows, label_order) if rows else {}
    weak, not_judged = baseline_problems(summary, t)
    cap = _capacity(summary, infos, t)
    if cannot or weak:
        chunked = chunked_vs_oneshot(rows) if rows else []
        return Verdict("CANNOT JUDGE", [*cannot, *weak, *reasons], summary, capacity=cap, chunked=chunked, digest=key)
    policies = _policies(rows, summary)
    chains, unordered = _chains(infos, policies)
    if unordered:
        return Verdict("CANNOT JUDGE", [*unordered, *reasons], summary, capacity=cap, digest=key)
    history = looks.history(recorded, key)
    cells = cell_decisions(policies, t)
    own = {n: cell_reasons(n, cells, t) + record_reasons(n, rs, summary[n], t) for n, rs in policies.items()}
    decisions = _decisions(policies, t, history.number, chains, own)
    now, runs = look_record(decisions, cells), sorted(str(i.get("run_id")) for i in infos)
    edited = looks.mismatches(recorded, key, t, runs, now)
    if edited:
        return Verdict("CANNOT JUDGE", [*edited, *reasons], summary, capacity=cap, digest=key)
    not_judged += _decided(decisions, cells, own, summary, t)
    searched = None if chains is None else search.found(chains, decisions, own, summary, cap, t)
    reasons, inconclusive, pending = _reasons(reasons, own, decisions, searched)
    status = "FAIL" if reasons else "INCONCLUSIVE" if inconclusive else "PASS"
    advised = status == "INCONCLUSIVE" or searched is not None  # a search advises on its pending budgets too
    advice, extend = _advice({n: decisions[n] for n in pending}, summary, infos, cells) if advised else (None, None)
    status, advice = _unfinished(status, advice, partial, inconclusive, t)
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
        look=looks.entry(history, key, status, t, runs, now),
        history=history,
        digest=key,
        partial=list(partial or []),
        declared=_declared(policies, infos, summary),  # marks their summaries declared
        non_default=non_default(t),
        search=searched.doc if searched is not None else None,
    )


def _unjudgeable(rows: list[Row], problems: list[str] | None, recorded: looks.Recorded) -> list[str]:
    """Why the records cannot be judged: the problems found while reading them (None: `rows` checked here, as the
    rows of one records file), no rows at all, and the recorded looks' own problems."""
    cannot = check_rows(rows, "the records") if problems is None else list(problems)
    if not rows and not cannot:
        cannot.append("no records")
    return cannot + recorded.problems


def _decided(
    decisions: dict[str, Decision], cells: list, own: dict[str, list[str]], summary: dict[str, Any], t: Thresholds
) -> list[str]:
    """Each judged variant's decision into its summary entry (`gate`) and its failures before its own reasons
    (`own`, in place); returns the notes on the cells not judged."""
    notes = []
    for name in own:
        summary[name]["gate"] = decision_summary(decisions[name], t)
        note = unjudged_cells(cells, name, t)
        notes += [note] if note else []
        own[name] = decisions[name].fail + own[name]
    return notes


def _declared(policies: dict[str, list[Row]], infos: list[dict], summary: dict[str, Any]) -> list[str]:
    """The variants whose KV bytes were declared by a server (declared_variants), their summaries marked so."""
    declared = declared_variants(policies, infos)
    for name in declared:
        summary[name]["kv_ratio_basis"] = "declared"
    return declared


def _reasons(
    reasons: list[str], own: dict[str, list[str]], decisions: dict[str, Decision], searched: search.Found | None
) -> tuple[list[str], list[str], list[str]]:
    """The verdict's reasons to FAIL, what is open, and the variants the advice is for: every variant's, or a
    search's (its policies' answers: a budget past one is reported, not failed on)."""
    if searched is None:
        opened = [o for n in own for o in decisions[n].open]  # `own` is in the variants' order
        return reasons + [r for n in own for r in own[n]], opened, list(own)
    return reasons + searched.fail, searched.open, searched.next


def _capacity(summary: dict[str, Any], infos: list[dict], t: Thresholds) -> dict[str, Any]:
    """The capacity line: a figure per model; with several, each counted against the largest model's weights."""
    weights = max((_field(i, "weights") or 0 for i in infos), default=0)
    return capacity(summary, weights, float(t.capacity["gpu_gib"]), int(t.capacity["context"]))


def _policies(rows: list[Row], summary: dict[str, Any]) -> dict[str, list[Row]]:
    """Each judged variant's rows (every variant but the baseline), in the summary's order."""
    by_variant: dict[str, list[Row]] = {}
    for r in rows:
        by_variant.setdefault(r.variant, []).append(r)
    return {name: by_variant[name] for name in summary if not is_baseline(name)}


def _decisions(
    policies: dict[str, list[Row]], t: Thresholds, number: int, chains: search.Chains | None, own: dict[str, list]
) -> dict[str, Decision]:
    """Each variant's decision: Holm across the variants, or a search's chains (a variant with reasons of its own,
    its cells or records, never tested there)."""
    if chains is None:
        return variant_decisions(policies, t, number)
    family = functools.partial(search.chain_family, chains=chains)
    return variant_decisions(policies, t, number, family, frozenset(n for n in own if own[n]))


def _chains(infos: list[dict], policies: dict[str, list[Row]]) -> tuple[search.Chains | None, list[str]]:
    """A search's chains (None for runs that are not a search), and why its variants cannot be judged as one."""
    searching, problems = search.is_search(infos)
    if not searching or problems:
        return None, problems
    chains, problems = search.chains_of(policies)
    return chains, problems


UNFINISHED = "the run is unfinished: finish it with resume=true, or judge it as it is with gate.allow_partial=true"


def _unfinished(
    status: str, advice: str | None, partial: list[str] | None, inconclusive: list[str], t: Thresholds
) -> tuple[str, str | None]:
    """(status, advice), an unfinished run's PASS made INCONCLUSIVE unless gate.allow_partial: it never PASSes, and
    the open reasons (`inconclusive`, in place) say why."""
    if partial and status == "PASS" and not t.allow_partial:
        inconclusive.append(f"{UNFINISHED} (gate.allow_partial is false)")
        return "INCONCLUSIVE", UNFINISHED
    return status, advice


def declared_variants(policies: dict[str, list[Row]], infos: list[dict]) -> list[str]:
    """Variants whose KV bytes no engine observed: declared from a dtype (backend=openai: a server does not report
    its cache; the rows say kv_bytes_source `declared: ...`, their run.json backend openai)."""
    runs = {str(i.get("run_id")) for i in infos if backend_of(i) == "openai"}
    return sorted(
        name
        for name, rs in policies.items()
        if any(str(r.run_id) in runs or str(r.get("kv_bytes_source", "")).startswith("declared") for r in rs)
    )


def run_reasons(infos: list[dict]) -> list[str]:
    """Runs that are not one configuration: other protocols or library versions, one model's different weights."""
    reasons = []
    for key, what in (("protocol", "protocol"), ("versions", "library versions")):
        seen = {json.dumps(_field(i, key), sort_keys=True) for i in infos}
        if len(seen) > 1:
            reasons.append(f"the runs differ in {what} ({len(seen)} different); gate runs of one configuration")
    for name in sorted({(i.get("model") or {}).get("name") for i in infos} - {None}):
        prints = {_field(i, "model") for i in infos if (i.get("model") or {}).get("name") == name}
        if len(prints) > 1:
            reasons.append(f"the runs of model {name} used different weights ({len(prints)} fingerprints)")
    return reasons


def cell_reasons(name: str, cells: list, t: Thresholds) -> list[str]:
    """The variant's cells shown below min_cell_accuracy."""
    return [
        f"{name}: cell {c.cell}: accuracy {c.policy:.2f} (baseline {c.baseline:.2f}, n={c.n}) shown below "
        f"{t.min_cell_accuracy} at {t.confidence:.0%} ({t.multiplicity} over the cells judged)"
        for c in cells
        if c.variant == name and c.status == SHOWN_TO_FAIL
    ]


def record_reasons(name: str, rows: list[Row], s: dict[str, Any], t: Thresholds) -> list[str]:
    """What the variant's records show broken whatever the statistics: a chunked prefill over its bound, compression
    asked but not in the bytes."""
    reasons = []
    over = [
        r
        for r in rows
        if r.get("prefill_bound_tokens") is not None and r["prefill_peak_tokens"] > r["prefill_bound_tokens"]
    ]
    if over:
        r = max(over, key=lambda r: r["prefill_peak_tokens"])
        reasons.append(
            f"{name}: the chunked prefill held {r['prefill_peak_tokens']} tokens in a layer, over its bound of "
            f"{r['prefill_bound_tokens']} (budget + chunk), on {len(over)} samples"
        )
    if any(compression_asked(r) for r in rows) and s["kv_ratio"] >= t.min_compression:
        clipped = s.get("budget_clipped")
        note = f" (its budget exceeds the context of {clipped} of {s['n']} samples: budget_clipped)" if clipped else ""
        reasons.append(
            f"{name}: compression was asked but its KV bytes are {s['kv_ratio']:.3f}x the full cache's "
            f"({s['kv_ratio_basis']}){note}"
        )
    return reasons


def _advice(
    decisions: dict[str, Any], summary: dict[str, Any], infos: list[dict], cells: list
) -> tuple[str | None, str | None]:
    """How many samples would settle an INCONCLUSIVE verdict, in the task's own terms where one run is judged, and
    the command that adds them to that run (extend_command; None where there is none); (None, None) for no
    variant."""
    if not decisions:
        return None, None
    needs = {name: d.samples_needed for name, d in decisions.items() if d.status == "INCONCLUSIVE"}
    if any(d.uneven for d in decisions.values()):
        return (
            "the documents' figures hold and their questions' do not: more documents, or documents with like numbers "
            "of questions, may settle it (no count follows from the observed rates)"
        ), None
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
        ran = len((infos[0].get("data") or {}).get("samples") or {})
        if _exhausted(task, ran):
            return (
                f"{text}; but the dataset is exhausted: all its {ran} rows were run, so no task.limit adds any: more "
                "samples need more data (a larger dataset or split)"
            ), None
        setting = f"task.limit={need}"
    else:
        return text, None
    return f"{text}, e.g. {setting} resume=true", extend_command(infos[0], setting)


def _exhausted(task: dict, ran: int) -> bool:
    """Whether a run took every row its dataset has (the whole of it, no limit reached): a larger limit adds none."""
    limit = task.get("limit")
    below = limit is None or (isinstance(limit, int) and ran < limit)
    return ran > 0 and task.get("fraction", 1.0) == 1 and below


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
    """A run.json field the verdict compares across runs, None where it is not of its kind (run_problems names it)."""
    model = info.get("model") if isinstance(info.get("model"), dict) else {}
    if key == "model":
        return model.get("fingerprint")
    if key == "weights":
        weights = model.get("weights_bytes")
        return weights if isinstance(weights, (int, float)) and not isinstance(weights, bool) else None
    if key == "versions":
        versions = info.get("versions") if isinstance(info.get("versions"), dict) else {}
        return {k: v for k, v in versions.items() if k in ("torch", "transformers", "evalkit")}
    return info.get(key)
