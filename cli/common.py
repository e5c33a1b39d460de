"""What the `ftune` command modules share: the consoles, the options, and how a command
fails (cli/main.py gathers the commands)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

PIPED_WIDTH = 200
# soft_wrap: a line is never cut or wrapped at the terminal's width (nor at 80 columns when
# piped): ids and log lines reach `| cat`, `| grep` and files whole.
console = Console(stderr=True, soft_wrap=True)
# Tables piped to a file or a pager: wide enough that no id or path is cut to fit 80 columns.
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else PIPED_WIDTH)

UrlOpt = Annotated[
    str | None,
    typer.Option(envvar="FTUNE_URL", show_default=False,
                 help="API base URL (default: the one `ftune up` serves, else "
                 "http://127.0.0.1:8000)."),
]
KeyOpt = Annotated[
    str | None, typer.Option(envvar="FTUNE_API_KEY", help="API key (default: embedded key).")
]
DataFileOpt = Annotated[
    Path | None,
    typer.Option(exists=True, dir_okay=False, readable=True, help="Upload this file as the dataset."),
]
EvalFileOpt = Annotated[
    Path | None,
    typer.Option(exists=True, dir_okay=False, readable=True, help="Upload this file as eval data."),
]


def fail(e: Exception) -> NoReturn:
    console.print(escape(str(e)), style="red")
    raise typer.Exit(1)
