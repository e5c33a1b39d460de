"""Data formats: which layouts users have, how to recognise them, how to convert them.

One home for reading examples: the API's checks at upload and submit
(core/data/files.py) and the trainer (core/data/datasets.py, core/train/preference.py) both
resolve the layout here and convert every row with the same converter, so what was checked
is what is trained. A new layout is one ``Layout`` (base.py) with its converter, added
with ``register`` (core/data/formats/registry.py); detection and the receipt then cover it.
"""

from __future__ import annotations

from core.data.formats.base import (
    Chat,
    Columns,
    DataProblem,
    Layout,
    Problems,
    Receipt,
    as_json,
    did_you_mean,
)
from core.data.formats.detect import Resolution, allowed_formats, columns_for, resolve
from core.data.formats.registry import LAYOUTS, register

# Formats whose rows become a Chat rendered with the chat template (supervised).
CHAT_FORMATS = ("chat", "alpaca", "sharegpt")


def convert_rows(
    ds: object, allowed: tuple[str, ...], rows: list[dict[str, object]]
) -> tuple[Resolution, list[object]]:
    """Rows already in memory (tests, benchmarks, previews) -> (resolution, examples).
    Raises ValueError naming the first row that does not convert."""
    from core.data.formats.detect import FormatError

    columns = list(dict.fromkeys(k for r in rows for k in r))
    try:
        res = resolve(ds, allowed, columns, rows[:20])
    except FormatError as e:
        raise ValueError(str(e)) from None
    examples = []
    for i, rec in enumerate(rows, start=1):
        out = Problems()
        ex = res.layout.convert(rec, res.columns, ds, out)
        if ex is None:
            raise ValueError(f"row {i}: {out.items[0] if out.items else 'cannot be read'}")
        examples.append(ex)
    return res, examples


__all__ = [
    "CHAT_FORMATS",
    "LAYOUTS",
    "Chat",
    "Columns",
    "DataProblem",
    "Layout",
    "Problems",
    "Receipt",
    "Resolution",
    "allowed_formats",
    "as_json",
    "columns_for",
    "convert_rows",
    "did_you_mean",
    "register",
    "resolve",
]
