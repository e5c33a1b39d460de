"""`ftune chat MODEL`: talk to a model served by ftune (a catalog id, an ``ft:`` name, a
checkpoint's name or a job id), its answer streamed as it comes; ``--vs OTHER`` asks a second
model the same (a fine-tuned model beside its base). One message with ``-m``, else a line at
a time from the terminal until an empty line or end of input."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Annotated

import httpx
import typer
from rich.markup import escape

from cli.connect import console, resolve_key, resolve_url, transport_error_text

MAX_HISTORY_MESSAGES = 40


def stream_chat(client: httpx.Client, model: str, messages: list[dict[str, str]],
                max_tokens: int, temperature: float) -> Iterator[str]:
    """The answer's text pieces as the server streams them; an error answer raises
    typer.Exit with the server's message."""
    body = {"model": model, "messages": messages, "stream": True, "max_tokens": max_tokens,
            "temperature": temperature}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code >= 400:
            r.read()
            try:
                err = r.json()["error"]
                text = f"error {r.status_code} {err.get('code')}: {err.get('message')}"
            except (ValueError, KeyError, TypeError):
                text = f"error {r.status_code}: {r.text[:500]}"
            if r.headers.get("retry-after"):
                text += f" (retry in {r.headers['retry-after']} s)"
            console.print(escape(text), style="red")
            raise typer.Exit(1)
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    yield piece


def chat(
    model: Annotated[str, typer.Argument(help="Catalog id, ft: name, checkpoint name or job id.")],
    message: Annotated[str | None, typer.Option("--message", "-m",
                                                help="Ask this once and exit.")] = None,
    vs: Annotated[str | None, typer.Option(help="A second model asked the same.")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, max=32_768)] = 256,
    temperature: Annotated[float, typer.Option(min=0.0, max=2.0)] = 0.0,
    url: Annotated[str | None, typer.Option(envvar="FTUNE_URL", show_default=False)] = None,
    api_key: Annotated[str | None, typer.Option(envvar="FTUNE_API_KEY")] = None,
) -> None:
    """Chat with a model served by ftune; its answer streams as it comes."""
    base = resolve_url(url)
    headers = {"Authorization": f"Bearer {resolve_key(api_key)}"}
    histories: dict[str, list[dict[str, str]]] = {model: [], **({vs: []} if vs else {})}
    try:
        with httpx.Client(base_url=base, headers=headers,
                          timeout=httpx.Timeout(600.0, connect=5.0)) as client:
            for text in _questions(message):
                for name, history in histories.items():
                    history.append({"role": "user", "content": text})
                    if vs:
                        sys.stdout.write(f"[{name}] ")
                    answer = []
                    for piece in stream_chat(client, name, history[-MAX_HISTORY_MESSAGES:],
                                             max_tokens, temperature):
                        answer.append(piece)
                        sys.stdout.write(piece)
                        sys.stdout.flush()
                    sys.stdout.write("\n")
                    history.append({"role": "assistant", "content": "".join(answer)})
    except httpx.TransportError as e:
        console.print(escape(transport_error_text(e, base)), style="red")
        raise typer.Exit(1) from None


def _questions(message: str | None) -> Iterator[str]:
    if message is not None:
        yield message
        return
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line.strip():
            return
        yield line.strip()
