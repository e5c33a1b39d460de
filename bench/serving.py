"""Serving through ftune vs the same vLLM server called directly (issue 37).

    python -m bench.serving [--streams 8] [--tokens 64] [--rounds 4] [--no-rate-limit]
                            [--split-cores]

Starts the embedded stack (API + one worker) with a tiny Llama in its catalog, and measures
  * cold start: the first chat request, from the deployment's request to its first token
    (the worker starts vLLM's CPU server; the request waits for it);
  * then, in alternating rounds (ftune, direct, ftune, direct, ...), ``--streams`` concurrent
    streaming chats of ``--tokens`` tokens each (ignore_eos: every answer is that long),
    once through ftune's /v1/chat/completions and once against the engine's own URL (read
    from the deployment row) with the same bodies: completion tokens per second of all
    streams together, and each stream's time to first token.
The API's inference rate limit is the default one (600 requests a minute a key, taken in
leases: api/services/rate_limits.py) unless ``--no-rate-limit`` turns it off, which shows
what the limit costs.
``--split-cores`` runs the engine (and the worker that starts it) on the machine's last core
and the API and this client on the others, as a production stack has them on other
machines than its GPUs: on one shared pair of cores the router's own CPU is taken from the
engine's, so the ratio then says how busy the cores are as much as what routing costs.
Prints the figures (ratio of tokens/s, ftune over direct; median TTFT difference) and writes
bench/results/serving.json. The same client code times both (httpx, one event loop).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import httpx

from bench.record import write_record

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL = "tiny-serve"


async def one_stream(client: httpx.AsyncClient, url: str, key: str, model: str,
                     tokens: int, i: int) -> tuple[float, float, int]:
    """(seconds to first token, seconds to the end, completion tokens)."""
    body = {"model": model, "stream": True, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"tell me story number {i}"}]}
    start = time.perf_counter()
    first, used = None, 0
    async with client.stream("POST", f"{url}/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and \
                    chunk["choices"][0].get("delta", {}).get("content"):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                used = int(chunk["usage"]["completion_tokens"])
    return (first or 0.0), time.perf_counter() - start, used


async def round_of(url: str, key: str, model: str, streams: int, tokens: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, url, key, model, tokens, i)
                                         for i in range(streams)))
        wall = time.perf_counter() - start
    return {"tokens_per_second": sum(r[2] for r in results) / wall,
            "ttft": [r[0] for r in results], "wall": wall}


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of process ``pid`` onto ``cores`` (sched_setaffinity is per thread)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except (ProcessLookupError, FileNotFoundError):
            pass  # a thread that ended meanwhile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--no-rate-limit", action="store_true",
                    help="no inference rate limit (FTUNE_INFERENCE_REQUESTS_PER_MINUTE_PER_KEY=0)")
    ap.add_argument("--split-cores", action="store_true",
                    help="the engine and the worker on the last core, the API and the client "
                         "on the others")
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if args.split_cores and len(cores) < 2:
        ap.error("--split-cores needs two cores")
    engine_cores, router_cores = {cores[-1]}, set(cores[:-1])
    if args.split_cores:  # what the stack starts inherits it: the worker, then its engine
        os.sched_setaffinity(0, engine_cores)

    from cli.embedded import EmbeddedStack
    from testkit.vllm_server import build_served_llama

    tmp = Path(tempfile.mkdtemp(prefix="ftune-bench-serving-"))
    model_dir = build_served_llama(tmp / "tiny-llama-serve")
    catalog = {MODEL: {"location": str(model_dir)}}
    stack = EmbeddedStack(data_dir=tmp / "data", env_overrides={
        "FTUNE_MODEL_CATALOG": json.dumps(catalog), "FTUNE_WORKER_GPUS": "0",
        "FTUNE_SERVING_START_WAIT_SECONDS": "600", "FTUNE_SERVING_POLL_SECONDS": "0.2",
        **({"FTUNE_INFERENCE_REQUESTS_PER_MINUTE_PER_KEY": "0"} if args.no_rate_limit else {})})
    stack.start()
    if args.split_cores:
        pin(stack.procs[0].pid, router_cores)  # the API (procs[1]: the worker stays)
        os.sched_setaffinity(0, router_cores)
    try:
        api = f"{stack.url}/v1"
        t0 = time.perf_counter()
        cold = asyncio.run(round_of(api, stack.api_key, MODEL, 1, 1))
        cold_start = time.perf_counter() - t0
        with sqlite3.connect(tmp / "data" / "ftune.db") as conn:
            url, key, started, ready = conn.execute(
                "SELECT url, engine_key, started_at, ready_at FROM deployments").fetchone()
        direct = f"{url}/v1"
        asyncio.run(round_of(direct, key, "base", args.streams, 8))  # warm both paths
        asyncio.run(round_of(api, stack.api_key, MODEL, args.streams, 8))
        ours: list[dict[str, Any]] = []
        theirs: list[dict[str, Any]] = []
        for _ in range(args.rounds):
            ours.append(asyncio.run(round_of(api, stack.api_key, MODEL, args.streams,
                                             args.tokens)))
            theirs.append(asyncio.run(round_of(direct, key, "base", args.streams,
                                               args.tokens)))
    finally:
        stack.stop()
    tps_ours = median(r["tokens_per_second"] for r in ours)
    tps_direct = median(r["tokens_per_second"] for r in theirs)
    ttft_ours = median(t for r in ours for t in r["ttft"])
    ttft_direct = median(t for r in theirs for t in r["ttft"])
    figures = {
        "streams": args.streams, "tokens": args.tokens, "rounds": args.rounds,
        "rate_limit": not args.no_rate_limit, "split_cores": args.split_cores,
        "cold_start_seconds": round(cold_start, 2), "cold_first_token_seconds":
            round(cold["ttft"][0], 2), "deployment_started_at": started,
        "deployment_ready_at": ready,
        "tokens_per_second_ftune": round(tps_ours, 1),
        "tokens_per_second_direct": round(tps_direct, 1),
        "tokens_per_second_ratio": round(tps_ours / tps_direct, 3),
        "ttft_median_ms_ftune": round(ttft_ours * 1000, 1),
        "ttft_median_ms_direct": round(ttft_direct * 1000, 1),
        "ttft_median_difference_ms": round((ttft_ours - ttft_direct) * 1000, 1),
        "rounds_tokens_per_second": {"ftune": [round(r["tokens_per_second"], 1) for r in ours],
                                     "direct": [round(r["tokens_per_second"], 1)
                                                for r in theirs]},
    }
    print(json.dumps(figures, indent=2))
    write_record("serving", figures)


if __name__ == "__main__":
    main()
