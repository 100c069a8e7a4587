"""Reading a Hugging Face dataset here, offline: a Hub id already in the datasets cache, a save_to_disk folder, or a
parquet / JSON / JSON-lines / CSV file (every column of a CSV read as text); an empty, non-UTF-8 or unparsable file,
or a Hub id with no local copy, is one line naming the file, the line and the fix."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from evalkit.errors import ConfigError
from evalkit.names import safe_name

FILES = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}


def fetch_command(path: str, config: str | None, data_dir: str | None, split: str) -> str:
    """The command that saves the dataset to a folder on a machine that reaches the Hub."""
    args = [repr(path)] + [f"{k}={v!r}" for k, v in (("name", config), ("data_dir", data_dir)) if v]
    folder = safe_name("-".join(str(x) for x in (path, config, data_dir) if x))
    return (
        f'python -c "import datasets; datasets.load_dataset({", ".join(args)}, split={split!r})'
        f".save_to_disk('{folder}')\" (then copy {folder}/ here and give task.path={folder})"
    )


def load(path: str, config: str | None = None, data_dir: str | None = None, split: str = "test"):
    """The dataset `path` names, as a datasets.Dataset; ConfigError (one line) when it cannot be had here."""
    import datasets

    local = Path(path).expanduser()
    try:
        if local.is_dir() and ((local / "dataset_info.json").exists() or (local / "dataset_dict.json").exists()):
            if _no_data_files(local / "state.json"):  # datasets fails on it with an IndexError naming nothing
                raise ConfigError(f"task.path={path!r} holds no rows (a dataset saved empty); give one with rows")
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ConfigError(f"task.split={split!r}: {path} holds the splits {sorted(ds)}; choose one")
                ds = ds[split]
            return ds
        if local.is_file() and local.suffix.lower() == ".csv" and len(local.read_bytes().strip().splitlines()) < 2:
            raise ConfigError(f"task.path={path!r} holds no rows (a header line only); give a file with rows")
        if local.is_file():
            builder = FILES.get(local.suffix.lower())
            if builder is None:
                raise ConfigError(f"task.path={path!r}: give a parquet, JSON, JSONL or CSV file, or a dataset folder")
            if builder != "parquet":
                check_text(local)
            if builder == "csv":  # every column as text: type guessing would read the answer 00731 as 731.0
                return datasets.load_dataset(
                    builder, data_files=str(local), split="train", features=_text_columns(local), na_filter=False
                )
            return datasets.load_dataset(builder, data_files=str(local), split="train")
        if local.is_dir():
            return datasets.load_dataset(str(local), name=config, data_dir=data_dir, split=split)
        if local.is_absolute() or path.startswith((".", "~")) or path.count("/") > 1:
            raise ConfigError(f"task.path={path!r} is not a file or folder here")
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - datasets raises many kinds for a file it cannot read
        raise ConfigError(
            f"task.path={path!r} cannot be read by datasets ({type(err).__name__}: {_first(err)})"
        ) from None
    offline = datasets.config.HF_HUB_OFFLINE or os.environ.get("HF_DATASETS_OFFLINE", "") not in ("", "0")
    try:
        return datasets.load_dataset(path, name=config, data_dir=data_dir, split=split)
    except ValueError as err:
        if "split" in str(err).lower() or "config" in str(err).lower():
            raise ConfigError(f"dataset {path!r}: {_first(err)}") from None
        raise ConfigError(_unavailable(path, config, data_dir, split, offline, err)) from None
    except Exception as err:  # noqa: BLE001 - not cached, not reachable, not on the Hub: one line either way
        raise ConfigError(_unavailable(path, config, data_dir, split, offline, err)) from None


def _no_data_files(state: Path) -> bool:
    """A save_to_disk folder's state.json that lists no data files (an empty dataset)."""
    try:
        return json.loads(state.read_text()).get("_data_files") == []
    except (OSError, ValueError, AttributeError):
        return False


def check_text(path: Path) -> None:
    """A JSON, JSON-lines or CSV file is UTF-8 text with rows in it, and a JSON-lines file one JSON value a line:
    else a ConfigError naming the line (datasets would name none)."""
    data = path.read_bytes()
    if not data.strip():
        raise ConfigError(f"task.path={str(path)!r} holds no rows (the file is empty); give a file with rows")
    lines = data.splitlines()
    for n, raw in enumerate(lines, start=1):
        try:
            raw.decode("utf-8-sig" if n == 1 else "utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(
                f"{path}:{n}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column {err.start + 1}); save the file "
                "as UTF-8"
            ) from None
    if path.suffix.lower() == ".json":
        try:
            json.loads(data.decode("utf-8-sig"))
            return  # one JSON document (a list of rows, or datasets' {"data": [...]})
        except json.JSONDecodeError:
            pass  # JSON lines in a .json file, checked line by line
    if path.suffix.lower() in (".json", ".jsonl"):
        for n, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                json.loads(raw.decode("utf-8-sig" if n == 1 else "utf-8"))
            except json.JSONDecodeError as err:
                why = f"not valid JSON ({err.msg} at column {err.colno})"
                raise ConfigError(f"{path}:{n}: {why}; fix the line") from None


def _text_columns(path: Path):
    """datasets Features reading every column of a CSV file as a string."""
    import datasets

    with path.open(newline="", encoding="utf-8-sig") as f:
        header = next(csv.reader(f), [])
    if not header:
        raise ConfigError(f"task.path={str(path)!r} has no header line naming its columns")
    return datasets.Features({name: datasets.Value("string") for name in header})


def _unavailable(path, config, data_dir, split, offline: bool, err: BaseException) -> str:
    where = "offline (HF_DATASETS_OFFLINE)" if offline else "from here"
    given = ", ".join(f"{k}={v}" for k, v in (("config", config), ("data_dir", data_dir), ("split", split)) if v)
    return (
        f"dataset {path!r} ({given}) "
        f"is not a local folder or file, and not in the datasets cache, and cannot be fetched {where} "
        f"({type(err).__name__}); on a machine that reaches the Hub run: {fetch_command(path, config, data_dir, split)}"
    )


def _first(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
