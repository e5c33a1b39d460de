"""A completions run's answers: the rendered messages of each item sent to the model's
OpenAI-compatible chat endpoint (``POST {base_url}/chat/completions``) with the run's
sampling parameters, at most ``concurrency`` requests in flight. The engine batches what
arrives together; this side only keeps it fed.

A request that fails (HTTP error, timeout, an answer that is not a chat completion) is that
item's error, never the run's: the item counts as errored with the reason on it."""

from __future__ import annotations

import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Self

import httpx

from core.evals.endpoint import Endpoint
from core.evals.spec import CompletionsSamplingParams

MAX_RESPONSE_BYTES = 4 << 20
# What a run asks for when its sampling_params leave it unset (OpenAI's defaults, and a
# bound on the answer so that a model that never stops cannot hold a run).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_MAX_COMPLETION_TOKENS = 256
USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens")


@dataclass
class Answer:
    text: str | None
    finish_reason: str = ""
    usage: dict[str, int] = field(default_factory=lambda: dict.fromkeys(USAGE_KEYS, 0))
    error: str | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class Sampling:
    """The sampling parameters as sent (every default resolved: output items report them)."""

    temperature: float
    top_p: float
    max_completion_tokens: int
    seed: int | None

    @classmethod
    def of(cls, sp: CompletionsSamplingParams | None) -> Sampling:
        sp = sp or CompletionsSamplingParams()
        return cls(
            temperature=DEFAULT_TEMPERATURE if sp.temperature is None else sp.temperature,
            top_p=DEFAULT_TOP_P if sp.top_p is None else sp.top_p,
            max_completion_tokens=sp.max_completion_tokens or DEFAULT_MAX_COMPLETION_TOKENS,
            seed=sp.seed,
        )


def request_body(endpoint: Endpoint, sampling: Sampling,
                 messages: list[dict[str, str]]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": endpoint.engine_model,
        "messages": messages,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_completion_tokens,
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    return body


def parse_answer(raw: bytes) -> Answer:
    try:
        obj = json.loads(raw)
        choice = obj["choices"][0]
        text = choice["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return Answer(None, error="the endpoint's answer is not a chat completion")
    usage = dict.fromkeys(USAGE_KEYS, 0)
    got = obj.get("usage") or {}
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        if isinstance(got.get(key), int):
            usage[key] = got[key]
    details = got.get("prompt_tokens_details") or {}
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        usage["cached_tokens"] = details["cached_tokens"]
    return Answer(text if isinstance(text, str) else "", str(choice.get("finish_reason") or ""),
                  usage)


class Generator:
    """Sends chat requests to one endpoint from a bounded pool of threads; ``close`` (or
    ``with``) stops it, dropping what has not started."""

    def __init__(self, endpoint: Endpoint, sampling: Sampling, *, concurrency: int,
                 timeout_seconds: float) -> None:
        self.endpoint = endpoint
        self.sampling = sampling
        headers = {"content-type": "application/json"}
        if endpoint.api_key:
            headers["authorization"] = f"Bearer {endpoint.api_key}"
        self.client = httpx.Client(
            base_url=endpoint.base_url, headers=headers, trust_env=False,
            timeout=httpx.Timeout(timeout_seconds),
            limits=httpx.Limits(max_connections=concurrency,
                                max_keepalive_connections=concurrency),
        )
        self.concurrency = concurrency
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="eval-gen")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()

    def retarget(self, endpoint: Endpoint) -> None:
        """Send what follows to ``endpoint`` (the same model's engine, restarted)."""
        if endpoint == self.endpoint:
            return
        self.endpoint = endpoint
        self.client.base_url = httpx.URL(endpoint.base_url)
        if endpoint.api_key:
            self.client.headers["authorization"] = f"Bearer {endpoint.api_key}"

    def submit(self, messages: list[dict[str, str]]) -> Future[Answer]:
        return self.pool.submit(self.complete, messages)

    def complete(self, messages: list[dict[str, str]]) -> Answer:
        t0 = time.perf_counter()
        body = json.dumps(request_body(self.endpoint, self.sampling, messages)).encode()
        try:
            with self.client.stream("POST", "/chat/completions", content=body) as r:
                raw = b""
                for chunk in r.iter_raw():
                    raw += chunk
                    if len(raw) > MAX_RESPONSE_BYTES:
                        return Answer(None, error=f"the answer is larger than "
                                      f"{MAX_RESPONSE_BYTES} bytes",
                                      seconds=time.perf_counter() - t0)
            if r.status_code != 200:
                answer = Answer(None, error=f"the endpoint answered HTTP {r.status_code}: "
                                f"{raw[:300].decode('utf-8', 'replace')}")
            else:
                answer = parse_answer(raw)
        except httpx.HTTPError as e:
            answer = Answer(None, error=f"calling the endpoint failed: {type(e).__name__}: {e}")
        answer.seconds = time.perf_counter() - t0
        return answer
