"""How a CLI command finds the server and says what went wrong talking to it.

The server URL and the key: an explicit `--url` / FTUNE_URL (and `--api-key` /
FTUNE_API_KEY) win; otherwise what `ftune up` remembered in its data directory (`url`,
`api_key`); otherwise the default address. Every failure of a conversation with the server
(it cannot be reached, the key is refused, a 4xx answer) becomes one readable message and
exit status 1 or 2, never a traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import typer
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from client import FtuneAPIError, FtuneClient

DEFAULT_URL = "http://127.0.0.1:8000"
URL_FILE = "url"
KEY_FILE = "api_key"
# Problems listed under a 4xx answer; the rest are counted (a file with 10,000 bad rows must
# not scroll the useful first lines off the screen).
MAX_DETAILS_SHOWN = 10

console = Console(stderr=True, soft_wrap=True)


def _data_dir() -> Path:
    from core.infra.settings import get_settings

    return get_settings().data_dir


def remember_url(data_dir: Path, url: str) -> Path:
    """`ftune up` writes where it serves, beside the key it keeps."""
    path = data_dir / URL_FILE
    path.write_text(url + "\n")
    return path


def forget_url(data_dir: Path, url: str) -> None:
    """On stop: only if it still names this server (another `ftune up` may have written it)."""
    path = data_dir / URL_FILE
    try:
        if path.read_text().strip() == url:
            path.unlink()
    except OSError:
        pass


def resolve_url(url: str | None) -> str:
    if url:
        return url
    try:
        remembered = (_data_dir() / URL_FILE).read_text().strip()
    except OSError:
        remembered = ""
    return remembered or DEFAULT_URL


def resolve_key(api_key: str | None) -> str:
    if api_key:
        return api_key
    key_file = _data_dir() / KEY_FILE
    try:
        return key_file.read_text().strip()
    except OSError:
        console.print("No API key: set FTUNE_API_KEY (or --api-key), or run `ftune up` here "
                      f"first (it keeps its key in {key_file}).", markup=False)
        raise typer.Exit(2) from None


def api_error_text(e: FtuneAPIError, url: str) -> str:
    """One readable block: the status and the server's message, the field, then the listed
    problems (at most MAX_DETAILS_SHOWN, the rest counted)."""
    if e.status == 401:
        return (f"the server at {url} refused the API key (401 {e.code}: {e.message}); set "
                "FTUNE_API_KEY to a key of this server (`ftune up` prints its key and keeps it "
                "in .ftune/api_key)")
    lines = [f"error {e.status} {e.code}: {e.message}"]
    if e.param and not e.details:
        lines.append(f"  field: {e.param}")
    for d in e.details[:MAX_DETAILS_SHOWN]:
        where = d.get("param") or ""
        row = d.get("row")
        if row is not None:
            where = f"row {row}" + (f", {where}" if where else "")
        lines.append(f"  - {where}: {d.get('message')}" if where else f"  - {d.get('message')}")
    more = len(e.details) - MAX_DETAILS_SHOWN
    if more > 0:
        lines.append(f"  ... and {more} more")
    return "\n".join(lines)


def transport_error_text(e: httpx.TransportError, url: str) -> str:
    reason = "connection refused" if isinstance(e, httpx.ConnectError) else type(e).__name__
    if isinstance(e, httpx.TimeoutException):
        reason = "no answer in time"
    return (f"cannot reach the ftune API at {url} ({reason}): start it with `ftune up`, or "
            "point --url / FTUNE_URL at the server")


@contextmanager
def connect(url: str | None, api_key: str | None) -> Iterator[FtuneClient]:
    """A client for the command; any failure talking to the server ends the command with
    one message on stderr and exit status 1."""
    from client import FtuneAPIError, FtuneClient

    base = resolve_url(url)
    key = resolve_key(api_key)
    try:
        with FtuneClient(base, key) as c:
            yield c
    except FtuneAPIError as e:
        console.print(escape(api_error_text(e, base)), style="red")
        raise typer.Exit(1) from None
    except httpx.TransportError as e:
        console.print(escape(transport_error_text(e, base)), style="red")
        raise typer.Exit(1) from None
    except httpx.InvalidURL as e:
        console.print(escape(f"not a usable server URL {base!r}: {e}"), style="red")
        raise typer.Exit(2) from None
