"""Every known layout, in one list: detection tries them, converters come from them.
A new layout is added with ``register`` (a module of its own calls it at import), or to
a family module's LAYOUTS below."""

from __future__ import annotations

# Each family module by its own name, never through the package: the package's __init__
# imports detect, which imports this module, so the package is half initialised here.
from core.data.formats.alpaca import LAYOUTS as ALPACA
from core.data.formats.base import Layout
from core.data.formats.openai_chat import LAYOUTS as OPENAI_CHAT
from core.data.formats.plain import LAYOUTS as PLAIN
from core.data.formats.preference import LAYOUTS as PREFERENCE
from core.data.formats.sharegpt import LAYOUTS as SHAREGPT

LAYOUTS: list[Layout] = [*PLAIN, *OPENAI_CHAT, *ALPACA, *SHAREGPT, *PREFERENCE]


def register(layout: Layout) -> None:
    if any(known.name == layout.name for known in LAYOUTS):
        raise ValueError(f"layout {layout.name!r} is registered already")
    LAYOUTS.append(layout)
