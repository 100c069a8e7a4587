"""Byte quantities as evalkit prints them: binary units with their IEC labels, one formatter for the console, the
reports, the gate and the plan (a MiB is 2**20 bytes: 17,971,200 bytes are 17.14 MiB, never "17.14 MB")."""

from __future__ import annotations

KiB, MiB, GiB = 2**10, 2**20, 2**30
UNITS = {"GiB": GiB, "MiB": MiB, "KiB": KiB}


def fmt_bytes(n: float | None, unit: str | None = None, digits: int = 2) -> str:
    """`n` bytes as '17.14 MiB'. `unit` fixes the unit (a table column compares best in one); None picks the largest
    unit not above `n` (bytes below a KiB are printed as a whole number of B). None prints as '-'."""
    if n is None:
        return "-"
    if unit is None:
        unit = next((u for u, size in UNITS.items() if abs(n) >= size), "B")
    if unit == "B":
        return f"{n:.0f} B"
    if unit not in UNITS:
        raise ValueError(f"unit={unit!r} is not one of {['B', *UNITS]}")
    return f"{n / UNITS[unit]:.{digits}f} {unit}"
