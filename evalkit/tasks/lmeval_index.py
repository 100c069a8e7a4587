"""evalkit's offline lm-eval tasks and lm-eval's task index with them: what task=lm_eval checks its task names against
before any model loads, and the task manager a run hands to lm-eval (no torch here; lm-eval itself is imported when
the index is first built).

lm-eval's TaskManager reads every one of its ~15,000 task YAML files when it is built (10 s of CPU). evalkit reads
them once per lm-eval version and keeps, in its cache, which of lm-eval's task folders each name needs (a task its
own folder; a group its folder and its members'; a tag its tasks'); a run's manager then indexes only those folders
and evalkit's own tasks, as a user does with `--include_path` and `include_defaults=False`. A name the cached list
does not hold gets lm-eval's full index, so lm-eval itself answers it."""

from __future__ import annotations

import functools
import json
from importlib.metadata import version
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

from platformdirs import user_cache_dir

from evalkit.embedded import user_cache
from evalkit.records import write_json

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

TASKS = ("evalkit_recall",)


def task_dir() -> Path:
    """A folder holding the bundled offline tasks' YAML, pointing at the bundled JSONL by absolute path."""
    out = Path(user_cache_dir("evalkit")) / "lmeval_tasks"
    out.mkdir(parents=True, exist_ok=True)
    src = files("evalkit.lmeval.bundled")
    for name in TASKS:
        data = Path(str(src / f"{name}.jsonl"))
        text = (src / f"{name}.yaml").read_text().replace("__DATA__", json.dumps(str(data)))
        (out / f"{name}.yaml").write_text(text)
    return out


def _defaults() -> Path:
    """lm-eval's own task folder."""
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def _cache_file() -> Path:
    return user_cache() / "lmeval_index" / f"lm_eval-{version('lm_eval')}.json"


def folders_needed(indexes: dict[str, dict[str, Any]]) -> dict[str, list[str] | None]:
    """For every name in lm-eval's task folders (`indexes`: folder -> lm-eval's index of that folder alone, name ->
    Entry, in lm-eval's order), the folders an index must read for lm-eval to load that name as its full index
    does: the folder of the first definition (lm-eval keeps the first; a tag, every folder that tags a task with it),
    and its members' for a group or a tag, recursively. None where indexing those folders apart could resolve a
    name differently (a name defined in two of them): that name needs lm-eval's full index."""
    where: dict[str, list[str]] = {}
    members: dict[str, set[str]] = {}
    tags: set[str] = set()
    for folder, index in indexes.items():
        for name, entry in index.items():
            where.setdefault(name, []).append(folder)
            if entry.kind.name == "TAG":
                tags.add(name)
                members.setdefault(name, set()).update(entry.tags)
            elif entry.kind.name == "GROUP" and len(where[name]) == 1:
                listed = (entry.cfg or {}).get("task") or []
                listed = listed if isinstance(listed, list) else [listed]
                named = (m if isinstance(m, str) else m.get("task") if isinstance(m, dict) else None for m in listed)
                members[name] = {m for m in named if isinstance(m, str)}

    def closure(name: str) -> set[str]:
        out, todo = set(), [name]
        while todo:
            n = todo.pop()
            if n in out or n not in where:
                continue
            out.add(n)
            todo.extend(members.get(n, ()))
        return out

    twice = [set(fs) for fs in where.values() if len(fs) > 1]
    result: dict[str, list[str] | None] = {}
    for name in where:
        folders = {f for n in closure(name) for f in (where[n] if n in tags else where[n][:1])}
        clash = len(folders) > 1 and any(len(fs & folders) > 1 for fs in twice)
        result[name] = None if clash else sorted(folders)
    return result


@functools.cache
def _folders() -> dict[str, list[str] | None]:
    """Name -> the lm-eval folders it needs (folders_needed), read from evalkit's cache or built there once per
    lm-eval version (write_json: of two processes building it at once, one whole file stays)."""
    path = _cache_file()
    try:
        return json.loads(path.read_text())["folders"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from lm_eval.tasks import TaskManager

    root = _defaults()
    order = sorted((p for p in root.iterdir() if p.is_dir() and p.name != "__pycache__"), key=lambda p: f"{p.name}/")
    indexes = {p.name: TaskManager(include_defaults=False, include_path=str(p)).task_index for p in order}
    folders = folders_needed(indexes)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"root": str(root), "folders": folders})
    return folders


def known_tasks() -> set[str]:
    """Every task, group and tag name lm-eval knows, evalkit's offline tasks included."""
    return set(_folders()) | set(TASKS)


def task_manager(
    names: list[str] | None = None, metadata: dict | None = None, include: list[str] | None = None
) -> TaskManager:
    """lm-eval's task manager with evalkit's offline tasks (or the folders `include` names), for `names`: indexing
    only the lm-eval folders those names need; all of lm-eval's when `names` is None, a name is not in the cached
    list, or a user's folder may define it."""
    from lm_eval.tasks import TaskManager

    bundled = [str(task_dir())]
    include = include or bundled
    own = include == bundled
    needed = [_folders().get(n) for n in (names or []) if not (own and n in TASKS)]
    if names is None or not own or any(f is None for f in needed):
        return TaskManager(include_path=include, metadata=metadata)
    root = _defaults()
    folders = sorted({f for fs in needed for f in fs})  # type: ignore[union-attr]
    return TaskManager(
        include_path=[str(root / f) for f in folders] + include, include_defaults=False, metadata=metadata
    )
