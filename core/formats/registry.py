"""Every known layout, in one list: detection tries them, converters come from them.
A new layout is added with ``register`` (a module of its own calls it at import), or to
a family module's LAYOUTS below."""

from __future__ import annotations

from core.formats import alpaca, openai_chat, plain, preference, sharegpt
from core.formats.base import Layout

LAYOUTS: list[Layout] = [
    *plain.LAYOUTS,
    *openai_chat.LAYOUTS,
    *alpaca.LAYOUTS,
    *sharegpt.LAYOUTS,
    *preference.LAYOUTS,
]


def register(layout: Layout) -> None:
    if any(known.name == layout.name for known in LAYOUTS):
        raise ValueError(f"layout {layout.name!r} is registered already")
    LAYOUTS.append(layout)
