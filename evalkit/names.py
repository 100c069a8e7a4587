"""Text made safe as one file or folder name: run folders named after overrides, the planner's output folder, the
folder a dataset is fetched into."""

from __future__ import annotations

import hashlib
import re

MAX_NAME = 200  # filesystems allow 255 bytes per name


def safe_name(text: str) -> str:
    """`text` as one folder name: path separators, `..`, shell glob and quoting characters and spaces become `_`
    or go (brackets of lists), so an override value can never climb out of the results folder or need quoting."""
    name = re.sub(r"[^A-Za-z0-9._=,@+%:-]", "_", str(text).replace("[", "").replace("]", ""))
    name = re.sub(r"_{2,}", "_", re.sub(r"\.{2,}", "_", name)).strip("._") or "_"
    if len(name) > MAX_NAME:  # a long sweep list: keep the start readable, make it unique by a digest
        name = f"{name[: MAX_NAME - 13]}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"
    return name
