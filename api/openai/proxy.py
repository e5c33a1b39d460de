"""Forwarding to the engine: the engine's bytes go out as they come (a stream, never
collected), with only the model name rewritten (the engine knows an adapter by its own
name) and the usage read from the engine's final chunk or response."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from core.serving.access import EngineTarget
from core.serving.deployments import ServingUnavailable

log = logging.getLogger("ftune.api")
# Waiting for the first byte may include a long prompt's prefill; then tokens come steadily.
# ``connect`` includes the wait for a free connection of the pool.
TIMEOUT = aiohttp.ClientTimeout(total=None, connect=30.0, sock_connect=5.0, sock_read=600.0)
# Why aiohttp and not httpx, which the rest of the service uses: every token of every
# stream passes through this client, and httpx (its pure-Python HTTP/1.1 parser, h11) spent
# 3.7x aiohttp's CPU per server-sent event: 205 against 56 us (bench/engine_client.py,
# docs/benchmarks.md). On a router core that also takes the requests, that was most of
# what ftune added to a stream (tokens/s 0.87 of direct with httpx, 0.97 with aiohttp).
_session: aiohttp.ClientSession | None = None


def session() -> aiohttp.ClientSession:
    """One connection pool per API process (keep-alive to the engines); made on first use,
    inside the event loop it belongs to."""
    global _session
    if _session is None or _session.closed:
        # trust_env off: an operator's HTTP(S)_PROXY is for the outside, not the engines.
        _session = aiohttp.ClientSession(
            timeout=TIMEOUT, trust_env=False,
            connector=aiohttp.TCPConnector(limit=1000, limit_per_host=0))
    return _session


async def close_client() -> None:
    global _session
    if _session is not None:
        await _session.close()
        _session = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


class NameSwap:
    """Rewrites ``"model":"<engine name>"`` into the user's name in the engine's JSON
    (vLLM writes compact JSON: one exact byte pattern)."""

    def __init__(self, target: EngineTarget) -> None:
        self.old = b'"model":' + json.dumps(target.engine_model).encode()
        self.new = b'"model":' + json.dumps(target.model).encode()

    def __call__(self, data: bytes) -> bytes:
        return data.replace(self.old, self.new)


class EngineResponse:
    """The engine's answer, its body not read yet: what the router needs of it, whatever
    the HTTP client underneath."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.content_type = response.headers.get("content-type", "")

    async def read(self) -> bytes:
        """The whole body (an error, or an answer that does not stream)."""
        try:
            return await self._response.read()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise ServingUnavailable(f"the model's engine broke off its answer "
                                     f"({type(e).__name__}); retry", retry_after=5) from None
        finally:
            self.close()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive."""
        async for data in self._response.content.iter_any():
            yield data

    def close(self) -> None:
        """Hand the connection back (kept alive if the body was read to its end)."""
        self._response.release()


async def open_stream(target: EngineTarget, path: str, body: dict[str, Any]) -> EngineResponse:
    """Send the request; the response's body is not read yet."""
    try:
        response = await session().post(target.base_url + path, json=body,
                                        headers=target.headers)
    except (TimeoutError, aiohttp.ClientError) as e:
        raise ServingUnavailable(f"the model's engine did not answer ({type(e).__name__}); "
                                 "it is being restarted", retry_after=5) from None
    return EngineResponse(response)


async def relay_events(response: EngineResponse, swap: NameSwap, usage: Usage, *,
                       keep_usage_chunk: bool) -> AsyncIterator[bytes]:
    """Server-sent events from the engine, each passed on as soon as it is whole. The usage
    chunk (``stream_options.include_usage``, always asked of the engine) is read into
    ``usage``, and passed on only if the user asked for it."""
    buffer = b""
    try:
        async for data in _raw(response):
            buffer += data
            end = buffer.rfind(b"\n\n")
            if end < 0:
                continue
            events, buffer = buffer[:end + 2], buffer[end + 2:]
            if b'"usage":{' in events:
                events = _take_usage(events, usage, keep_usage_chunk)
            if events:
                yield swap(events)
        if buffer:
            yield swap(buffer)
    finally:
        response.close()


async def _raw(response: EngineResponse) -> AsyncIterator[bytes]:
    """The engine's bytes; an engine that dies mid-answer ends the stream with an error
    event (OpenAI's way), not a broken connection."""
    try:
        async for data in response.chunks():
            yield data
    except (TimeoutError, aiohttp.ClientError) as e:
        log.warning("the engine's stream broke off: %s", e)
        error = {"error": {"message": "the model's engine stopped while answering; retry",
                           "type": "server_error", "param": None, "code": "engine_unavailable"}}
        yield b"\n\ndata: " + json.dumps(error).encode() + b"\n\n"


def _take_usage(events: bytes, usage: Usage, keep: bool) -> bytes:
    out = []
    for event in events.split(b"\n\n"):
        if not event:
            continue
        if event.startswith(b"data: {") and b'"usage":{' in event:
            try:
                chunk = json.loads(event[len(b"data: "):])
            except ValueError:
                chunk = {}
            u = chunk.get("usage") or {}
            usage.prompt_tokens = int(u.get("prompt_tokens") or usage.prompt_tokens)
            usage.completion_tokens = int(u.get("completion_tokens") or usage.completion_tokens)
            if not keep and not chunk.get("choices"):
                continue
        out.append(event + b"\n\n")
    return b"".join(out)


def usage_of(payload: Any) -> Usage:
    u = payload.get("usage") if isinstance(payload, dict) else None
    if not isinstance(u, dict):
        return Usage()
    return Usage(int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0))


def openai_error(payload: Any, status: int, *, prompt_param: str) -> dict[str, Any]:
    """The engine's error in OpenAI's shape: ``param`` without the ``body.`` of its location,
    ``code`` a string (vLLM writes the HTTP status there), a context overflow named as
    OpenAI names it (on ``prompt_param``: messages or prompt)."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(err, dict):
        err = {"message": str(payload)[:2000]}
    message = str(err.get("message") or "the engine refused the request")
    param = err.get("param")
    if isinstance(param, str):
        param = param.removeprefix("body.") or None
    code = err.get("code") if isinstance(err.get("code"), str) else None
    if "maximum context length" in message:
        code, param = "context_length_exceeded", prompt_param
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
