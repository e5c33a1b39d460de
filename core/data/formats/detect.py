"""Which layout a file holds: from the spec's format (or ``auto``) and the rows' columns.

``auto`` tries every layout of the formats the job can train on (by task and objective);
a layout matches when the file has all of its required columns and a sample row has its
shapes. The most specific match wins (more required columns: prompt/chosen/rejected over
chosen/rejected); two equally specific matches of different formats are ambiguous and
refused, as is no match, naming the columns found and the layouts that came close.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.data.formats.base import Columns, DataProblem, Layout, Receipt, did_you_mean
from core.data.formats.registry import LAYOUTS
from core.spec import FORMATS_BY_TASK, PREFERENCE_FORMAT, DatasetSpec

# The spec's older *_field options name the column of a role for every layout using it.
LEGACY_FIELDS = {
    "text": "text_field",
    "prompt": "prompt_field",
    "completion": "completion_field",
    "messages": "messages_field",
    "input": "input_field",
    "target": "target_field",
    "label": "label_field",
    "kto_tag": "label_field",
    "chosen": "chosen_field",
    "rejected": "rejected_field",
}


@dataclass
class Resolution:
    layout: Layout
    columns: Columns  # role -> file column
    params: dict[str, str]  # role -> the spec parameter that names its column
    detected: bool

    def receipt(self, file_columns: list[str]) -> Receipt:
        used = {r: c for r, c in self.columns.items() if c in file_columns}
        return Receipt(
            format=self.layout.format,
            layout=self.layout.name,
            detected=self.detected,
            columns_used=used,
            columns_ignored=[c for c in file_columns if c not in used.values()],
        )

    def param_of(self, column: str) -> str | None:
        for role, col in self.columns.items():
            if col == column:
                return self.params[role]
        return None


def allowed_formats(task: str, objective: str) -> tuple[str, ...]:
    if objective != "sft":
        return (PREFERENCE_FORMAT[objective],)
    return tuple(f for f in FORMATS_BY_TASK[task] if f not in ("preference", "kto"))


def columns_for(layout: Layout, ds: Any) -> tuple[Columns, dict[str, str]]:
    """role -> column, and role -> the spec parameter naming it: ``dataset.columns`` first,
    then an explicitly set *_field option, then the layout's usual name."""
    mapping = getattr(ds, "columns", None) or {}
    explicit: set[str] = getattr(ds, "model_fields_set", set())
    cols: Columns = {}
    params: dict[str, str] = {}
    for role in layout.roles():
        legacy = LEGACY_FIELDS.get(role)
        if role in mapping:
            cols[role], params[role] = mapping[role], f"dataset.columns.{role}"
        elif legacy is not None and legacy in explicit:
            cols[role], params[role] = getattr(ds, legacy), f"dataset.{legacy}"
        else:
            # The parameter that would rename it: the older *_field option where the
            # role has one, else dataset.columns.<role>.
            where = f"dataset.{legacy}" if legacy else f"dataset.columns.{role}"
            cols[role], params[role] = layout.defaults[role], where
    return cols, params


@dataclass
class NearMiss:
    """A layout that came close to a file: the columns it lacks (none: the columns are
    there and hold other shapes, e.g. {from, value} turns where {role, content} are read)."""

    layout: str
    format: str
    missing: list[str]

    def describe(self, file_columns: list[str]) -> str:
        if not self.missing:
            return f"{self.layout} (its columns hold other shapes)"
        named = ", ".join(repr(c) + did_you_mean(c, file_columns) for c in self.missing)
        return f"{self.layout} (missing {named})"

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout, "format": self.format, "missing": self.missing}


class FormatError(ValueError):
    def __init__(
        self,
        problems: list[DataProblem],
        near_misses: list[NearMiss] | None = None,
        candidates: list[str] | None = None,
    ) -> None:
        self.problems = problems
        self.near_misses = near_misses or []  # no match: the closest layouts
        self.candidates = candidates or []  # ambiguous: the layouts that all fit
        super().__init__("; ".join(str(p) for p in problems))


def _shape_ok(layout: Layout, cols: Columns, sample: list[dict[str, Any]], ds: Any) -> bool:
    for rec in sample:
        if all(cols[r] in rec for r in layout.required):
            try:
                return bool(layout.looks_right(rec, cols, ds))
            except Exception:  # noqa: BLE001 - a shape test never fails detection
                return False
    return False


def _needs(layout: Layout, cols: Columns) -> str:
    return f"{layout.name} ({', '.join(cols[r] for r in layout.required)})"


def resolve(
    ds: Any,
    allowed: tuple[str, ...],
    file_columns: list[str],
    sample: list[dict[str, Any]],
    layouts: list[Layout] | None = None,
) -> Resolution:
    """The layout of a file. Raises FormatError for no match or an ambiguous one (auto),
    or when the named format does not fit (one problem naming the formats' needs)."""
    if layouts is None:
        layouts = LAYOUTS
    auto = ds.format == "auto"
    wanted = allowed if auto else (ds.format,)
    candidates = [lay for lay in layouts if lay.format in wanted]
    present = set(file_columns)
    found = ", ".join(file_columns) or "none"
    scored = []
    for lay in candidates:
        cols, params = columns_for(lay, ds)
        missing = [cols[r] for r in lay.required if cols[r] not in present]
        shape = not missing and _shape_ok(lay, cols, sample, ds)
        scored.append((lay, cols, params, missing, shape))
    matches = [s for s in scored if s[4]]
    if matches:
        best = max(len(s[0].required) for s in matches)
        top = [s for s in matches if len(s[0].required) == best]
        if len(top) > 1:
            names = " and ".join(_needs(s[0], s[1]) for s in top)
            raise FormatError([DataProblem(
                None, None,
                f"the columns fit more than one format: {names}; the rows have {found}. "
                "Set dataset.format (and dataset.columns) to say which",
                "dataset.format",
            )], candidates=[s[0].name for s in top])
        lay, cols, params, _, _ = top[0]
        return Resolution(lay, cols, params, detected=auto)
    if not auto:
        # The format is named: take its layout with all columns present (most specific
        # first), else the closest; the row check then names each problem (a column
        # missing from every row once: datafiles.check_rows).
        complete = sorted((s for s in scored if not s[3]), key=lambda s: -len(s[0].required))
        lay, cols, params, _, _ = (complete or sorted(scored, key=lambda s: len(s[3])))[0]
        return Resolution(lay, cols, params, detected=False)
    close = sorted(
        (s for s in scored if len(s[3]) < len(s[0].required) or s[3] == []),
        key=lambda s: (len(s[3]), -len(s[0].required)),
    )
    misses = [NearMiss(s[0].name, s[0].format, list(s[3])) for s in close[:4]]
    if misses:
        came = "; closest: " + "; ".join(m.describe(file_columns) for m in misses)
    else:
        came = "; formats tried: " + ", ".join(_needs(s[0], s[1]) for s in scored)
    raise FormatError([DataProblem(
        None, None,
        f"no data format matches the columns found ({found}){came}. Rename the columns, "
        "map them with dataset.columns, or set dataset.format",
        "dataset.format",
    )], near_misses=misses)


def detect_upload(file_columns: list[str], sample: list[dict[str, Any]]) -> dict[str, Any]:
    """What an uploaded file holds, said on its file object: the layout ``format: auto``
    finds among every format (the job's task and objective may narrow the choice at
    submit, whose receipt says what was used), its columns used and ignored; or, where
    none or several fit, why, with the layouts that came close or that all fit."""
    every = tuple(dict.fromkeys(f for fs in FORMATS_BY_TASK.values() for f in fs))
    ds = DatasetSpec(file_id="upload")  # format auto, the usual column names
    try:
        res = resolve(ds, every, file_columns, sample)
    except FormatError as e:
        return {
            "format": None,
            "layout": None,
            "message": e.problems[0].message if e.problems else str(e),
            "near_misses": [m.to_dict() for m in e.near_misses],
            "candidates": e.candidates,
        }
    receipt = res.receipt(file_columns)
    return {
        "format": receipt.format,
        "layout": receipt.layout,
        "columns_used": receipt.columns_used,
        "columns_ignored": receipt.columns_ignored,
    }
