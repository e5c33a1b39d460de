"""The router's HTTP client, per server-sent event: httpx against aiohttp (issue 37).

    python -m bench.engine_client [--streams 8] [--events 64] [--rounds 20]

Every token of every stream served through ftune passes through the API's client to the
engine (api/openai/proxy.py). This measures what that client alone costs: a local server
(another process, on another core where there is one) streams ``--events`` events of
vLLM's chunk shape to ``--streams`` concurrent requests, ``--rounds`` times, and each
client reads them as the router does (kept-alive connections, the body's bytes as they
come). Printed: CPU seconds of the client process per library and per event, and the
ratio. Runs alternate (httpx, aiohttp, httpx, aiohttp) so a change in the machine's load
falls on both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import time
from collections.abc import Callable, Coroutine
from statistics import median
from typing import Any

import aiohttp
import httpx

from bench.record import write_record

CHUNK = {"id": "chatcmpl-0", "object": "chat.completion.chunk", "created": 1, "model": "base",
         "choices": [{"index": 0, "delta": {"content": " tok"}, "logprobs": None,
                      "finish_reason": None}]}
BODY = {"model": "base", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def serve(port: int, events: int, cores: set[int]) -> None:
    """The fake engine: ``events`` events a request, 2 ms apart (a decode step)."""
    import uvicorn

    if cores:
        os.sched_setaffinity(0, cores)
    event = b"data: " + json.dumps(CHUNK, separators=(",", ":")).encode() + b"\n\n"

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(events):
            await send({"type": "http.response.body", "body": event, "more_body": True})
            await asyncio.sleep(0.002)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


async def with_httpx(url: str, streams: int, rounds: int) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        async def one() -> None:
            request = client.build_request("POST", url, json=BODY)
            response = await client.send(request, stream=True)
            async for _ in response.aiter_raw():
                pass
            await response.aclose()

        for _ in range(rounds):
            await asyncio.gather(*(one() for _ in range(streams)))


async def with_aiohttp(url: str, streams: int, rounds: int) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def one() -> None:
            response = await session.post(url, json=BODY)
            async for _ in response.content.iter_any():
                pass
            response.release()

        for _ in range(rounds):
            await asyncio.gather(*(one() for _ in range(streams)))


def cpu_seconds(run: Callable[[str, int, int], Coroutine[Any, Any, None]], url: str,
                streams: int, rounds: int) -> float:
    start = time.process_time()
    asyncio.run(run(url, streams, rounds))
    return time.process_time() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--events", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    client_cores, server_cores = {cores[0]}, set(cores[1:])
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(
        target=serve, args=(port, args.events, server_cores), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.post(url, json=BODY, timeout=5)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        if len(cores) > 1:
            os.sched_setaffinity(0, client_cores)
        seconds: dict[str, list[float]] = {"httpx": [], "aiohttp": []}
        for _ in range(2):
            seconds["httpx"].append(cpu_seconds(with_httpx, url, args.streams, args.rounds))
            seconds["aiohttp"].append(cpu_seconds(with_aiohttp, url, args.streams,
                                                  args.rounds))
    finally:
        server.terminate()
        server.join(10)
    events = args.streams * args.rounds * args.events
    figures: dict[str, Any] = {"streams": args.streams, "events": args.events,
                               "rounds": args.rounds, "cpu_seconds": seconds}
    for name, runs in seconds.items():
        figures[f"{name}_us_per_event"] = round(median(runs) / events * 1e6, 1)
    figures["httpx_over_aiohttp"] = round(median(seconds["httpx"]) /
                                          median(seconds["aiohttp"]), 2)
    print(json.dumps(figures, indent=2))
    write_record("engine_client", figures, args=args)


if __name__ == "__main__":
    main()
