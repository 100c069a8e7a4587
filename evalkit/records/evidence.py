"""What the gate re-derives from the records, and refuses when the records contradict it: each row on its own and
against its sample's baseline row (evalkit.records.checks, what a resumed run checks too), then what only the gate
derives here (each score from its prediction, the fields an engine's rows must carry, run.json's identity).

The gate believes no number a row claims that it can derive from another row or from run.json:

- a variant row's `baseline_score`, `flip`, `kv_bytes_baseline`, `context_id` and `document_id` must equal what the
  baseline row of the same sample in the same file says (its `score`, the flip the two scores make, its `kv_bytes`,
  its context and document);
- a document is the gate's unit (evalkit.gate.contexts): rows that share a prefilled context share its document, and
  outside protocol=query_aware the prefilled context is the document (`document_id` equals `context_id`);
- scores are finite and within the scorers' range [0, 1]; KV bytes finite and non-negative, the full cache's above 0;
- a variant's tokens held, summed over its layers, are within what its policy contract allowed (`tokens_allowed_per
  _layer`, the budget plus the tokens the policy declares protected, evalkit.contract), and its deployed bytes match
  the tokens it holds (dense storage: the baseline's bytes per token and layer times the tokens held; quantized
  storage: at most that);
- every score is the one the task's scorer gives the row's prediction (evalkit.scoring; the scorer the run's task
  config names; a teacher-forced row's, its top-1 agreement), and a variant row's answers and scorer are its
  baseline row's;
- a row of evalkit's engine carries its context, tokens and deployed bytes, and a variant's rows carry a KL on every
  row or on none: a deleted field is refused, never a check dropped;
- every row carries the deployed bytes of the cache its answer was decoded from and its baseline's (rows written
  before are refused, with the command to rerun), and the baseline's equal what the baseline row holds;
- a variant row of evalkit's engine records the class of the policy that ran, and its label is the one that class,
  its settings, storage and prefill derive (evalkit.records.labels): `policy=none policy.name=snapkv` runs as
  `none[snapkv]@...`, and a row relabelled by hand is refused;
- run.json carries the resolved config, the model fingerprint and the library versions, and every field the gate
  reads there is of its kind (an object where one is read: `model`, `config.task`, `data.files`, `engine.endpoints`);
- a task's kind (teacher-forced, scored by lm-eval) is its class (`_target_`), never a flag in run.json;
- a sample is identified across folders by its content digest and its id where run.json records one, else by its
  run's sample identity and its id (evalkit.records.sample_key): rows of different runs whose ids collide are never
  taken for the same sample, and the same sample drawn again under another seed is never two
  (evalkit.records.merged.merge).

Each contradiction names `file:line` and the field; the gate then says CANNOT JUDGE (exit 2).
"""

from __future__ import annotations

from typing import Any

from evalkit import scoring
from evalkit.records import BASELINE, Row
from evalkit.records.checks import EDITED, shared_endpoints
from evalkit.records.labels import row_label

RUN_NEEDS = (
    ("config", dict),
    ("model.fingerprint", str),
    ("versions.torch", str),
    ("versions.transformers", str),
    ("versions.evalkit", str),
)


def undocumented(rows: list[Row], where: str) -> list[str]:
    """protocol=query_aware rows without a document_id: each question compressed its document with it, so their
    contexts differ per question and the gate cannot tell which questions share a document (the unit)."""
    bare = [r for r in rows if r.protocol == "query_aware" and r.get("document_id") is None]
    if not bare:
        return []
    return [
        f"{where}: {len(bare)} protocol=query_aware rows without document_id (sample {bare[0].sample_id!r} "
        "first): the gate cannot tell which questions were asked on one document, its unit; rerun the run with "
        "this evalkit, which records each row's document"
    ]


# What every row of evalkit's own engine records (hf: the run's loop and lm-eval's): without them the bytes a row
# claims could not be set against the tokens it held, nor its context against the baseline's
HF_FIELDS = (
    "compression_asked",
    "policy",
    "tokens_held_per_layer",
    "tokens_allowed_per_layer",
    "kv_bytes_deployed",
    "kv_bytes_baseline_deployed",
    "context_id",
)
MISSING = "a field the gate judges was deleted: restore the run's own rows, or rerun it"
# What every engine's rows record since the gate judges the cache decoded from: rows written before are refused
DECODED_FIELDS = ("decode_peak_kv_bytes_deployed", "decode_peak_kv_bytes_baseline_deployed")
OLDER = (
    "was written before evalkit recorded {what}, which the gate judges; rerun it into a new folder with this evalkit "
    "(python -m evalkit ... resume=false)"
)


def backend_of(info: dict) -> str:
    """The engine a run's config names (config.backend.name); runs written before backends existed ran on hf."""
    backend = (info.get("config") or {}).get("backend")
    return str(backend.get("name")) if isinstance(backend, dict) and backend.get("name") else "hf"


def task_config(info: dict) -> dict:
    task = (info.get("config") or {}).get("task")
    return task if isinstance(task, dict) else {}


def judged_fields(rows: list[dict], lines: list[int], path: str, info: dict) -> list[str]:
    """What one run's rows must carry for the gate to judge them, and what it re-derives from them: every score
    from its prediction by the task's scorer (teacher-forced rows: from their top-1 agreement), the engine's own
    fields on an hf run's rows, a KL on every row of a variant once any has one. Each names file:line."""
    want, engine = scoring.expected(task_config(info)), backend_of(info)
    forced = scoring.teacher_forced(task_config(info))
    with_kl = {r.variant for r in rows if r.get("kl_mean") is not None}
    out = []
    for r, n in zip(rows, lines, strict=True):
        why = (
            _engine(r, engine)
            or (_forced(r) if forced else _rescored(r, want))
            or _kl(r, forced or r.variant in with_kl)
        )
        if why:
            out.append(f"{path}:{n}: {why}")
    return out[:LISTED] + ([f"{path}: {len(out) - LISTED} more rows like these"] if len(out) > LISTED else [])


LISTED = 3  # rows named per file; the rest are counted


def _engine(r: Row, engine: str) -> str | None:
    if r.get("backend") is not None and r["backend"] != engine:
        return f"has backend={r['backend']!r} but its run.json ran backend {engine!r}; {EDITED}"
    if engine != "hf" and str(r.get("engine_version", "")).startswith("transformers "):
        return (
            f"has engine_version={r['engine_version']!r}, evalkit's own engine, but its run.json ran backend "
            f"{engine!r}; {EDITED}"
        )
    if any(r.get(k) is None for k in DECODED_FIELDS):
        decoded = ", ".join(DECODED_FIELDS)
        return OLDER.format(what=f"the bytes of the cache each answer was decoded from ({decoded})")
    missing = [k for k in HF_FIELDS if r.get(k) is None] if engine == "hf" else []
    if missing:
        return f"has no {', '.join(missing)} (every row evalkit's engine writes has them); {MISSING}"
    return _ran(r) if engine == "hf" else None


def _ran(r: Row) -> str | None:
    """A row of evalkit's engine names the policy that ran: its record carries the class, and its label is the one
    that class, its settings, storage and prefill derive (evalkit.records.labels), not a name typed beside them."""
    if r.variant == BASELINE:
        return None
    if not isinstance(r["policy"], dict) or not isinstance(r["policy"].get("class"), str):
        return OLDER.format(what="the class of the policy that ran (policy.class)")
    derived = row_label(r)
    if derived != r.variant:
        return (
            f"is labelled {r.variant!r} but records {r['policy']['class']} at budget {r['policy'].get('budget')!r}, "
            f"which is {derived!r}: a label is derived from the policy that ran; {EDITED}"
        )
    return None


def _rescored(r: Row, want: str | None) -> str | None:
    why = scoring.problem(r, want)
    return f"{why}; {EDITED}" if why else None


def _forced(r: Row) -> str | None:
    """A teacher-forced row's score is its top-1 agreement with the baseline's logits (the baseline's own: 1)."""
    agreement = r.get("top1_agreement")
    if agreement is None:
        return f"has no top1_agreement: a teacher-forced row's score is its top-1 agreement; {MISSING}"
    if r.score != agreement:
        return f"score={r.score!r} but its top1_agreement is {agreement!r} (a teacher-forced row scores it); {EDITED}"
    return None


def _kl(r: Row, needed: bool) -> str | None:
    if needed and r.get("kl_mean") is None:
        return (
            "has no kl_mean, which the other rows of its variant (or of a teacher-forced task) carry: the KL check "
            f"would be dropped for all of them; {MISSING}"
        )
    return None


def _texts(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(x, str) for x in v.values())


# run.json's fields the gate reads beyond RUN_NEEDS, each with what it must be when present: names it compares, sets
# and sorts are strings (a list is unhashable, a number sorts against no string)
KINDS = (
    ("run_id", lambda v: isinstance(v, str), "a string"),
    ("protocol", lambda v: isinstance(v, str), "a string"),
    ("command", lambda v: isinstance(v, list), "a list, the command line"),
    ("versions", _texts, "an object of version strings"),
    ("model", lambda v: isinstance(v, dict), "an object"),
    ("model.name", lambda v: isinstance(v, str), "a string"),
    ("config.model", lambda v: isinstance(v, dict), "an object"),
    ("config.model.name", lambda v: isinstance(v, str), "a string"),
    ("config.task.name", lambda v: isinstance(v, str), "a string"),
    ("config.backend.name", lambda v: isinstance(v, str), "a string"),
    ("model.weights_bytes", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0, "bytes"),
    ("config.task", lambda v: isinstance(v, dict), "an object"),
    ("config.backend", lambda v: isinstance(v, dict), "an object"),
    ("engine", lambda v: isinstance(v, dict), "an object"),
    ("engine.endpoints", lambda v: isinstance(v, dict), "an object, a server per variant"),
    ("data", lambda v: isinstance(v, dict), "an object"),
    ("data.files", _texts, "an object, a digest per input file"),
    ("data.samples", _texts, "an object, a digest per sample"),
)


def _at(info: dict, dotted: str) -> Any:
    """run.json's field at a dotted path (`model.fingerprint`), None where a step is missing or not an object."""
    node: Any = info
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _kinds(info: dict) -> list[str]:
    kinds = ((dotted, _at(info, dotted), fits, what) for dotted, fits, what in KINDS)
    return [
        f"{dotted} is {_shown(node)}, not {what}"
        for dotted, node, fits, what in kinds
        if node is not None and not fits(node)
    ]


def _shown(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else f"{text[: width - 3]}..."


def run_problems(info: dict, path: str) -> list[str]:
    """What a run.json lacks that the gate needs: its config, the model fingerprint, the library versions."""
    needs = ((dotted, kind, _at(info, dotted)) for dotted, kind in RUN_NEEDS)
    missing = [dotted for dotted, kind, node in needs if not isinstance(node, kind) or not node]
    out = (
        []
        if not missing
        else [
            f"{path}: lacks {', '.join(missing)}: the gate compares runs by their config, model weights and library "
            "versions; judge the run.json its run wrote, or rerun it"
        ]
    )
    out += [f"{path}: {what}; judge the run.json its run wrote, or rerun it" for what in _kinds(info)]
    engine = info.get("engine")
    shared = shared_endpoints(engine.get("endpoints")) if isinstance(engine, dict) else None
    if shared:
        out.append(f"{path}: {shared}: a server compared with itself shows nothing; rerun, each variant on its server")
    return out
