"""score_model graders: a judge model behind an OpenAI-compatible chat endpoint that the
operator configures (FTUNE_GRADER_JUDGE_URL, e.g. a vLLM server's http://host:8000/v1).

The URL is checked with the webhooks' address guard before every call (public addresses
only unless the operator allows networks), and the call connects to the very address that
was checked. The judge's answer is its message text; the score is the first number in it
(a JSON object {"score": x} or {"result": x} is read too), rescaled from the grader's
range to [0, 1]."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx

from core.infra import netguard
from core.spec.graders import SamplingParams, ScoreModelGrader

MAX_RESPONSE_BYTES = 1 << 20
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


class JudgeError(RuntimeError):
    """The judge could not be called or gave no score; the message says why."""


class Judge:
    def __init__(
        self,
        url: str,
        policy: netguard.NetPolicy,
        api_key: str | None = None,
        timeout_seconds: float = 60.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.policy = policy
        self.api_key = api_key
        self.client = httpx.Client(
            follow_redirects=False,
            trust_env=False,  # no proxy from the environment: the checked address is called
            timeout=httpx.Timeout(timeout_seconds),
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    def close(self) -> None:
        self.client.close()

    def score(self, grader: ScoreModelGrader, messages: list[dict[str, str]]) -> float:
        """The judge's score for rendered messages, rescaled to [0, 1] (not clipped: a
        score outside the grader's range is the caller's to count)."""
        content = self.complete(grader.model, messages, grader.sampling_params)
        raw_score = parse_score(content)
        lo, hi = grader.range or [0.0, 1.0]
        return (raw_score - lo) / (hi - lo)

    def complete(self, model: str, messages: list[dict[str, str]],
                 sp: SamplingParams | None = None) -> str:
        """The judge's answer (its message text) to rendered messages."""
        try:
            target = netguard.check_url(f"{self.url}/chat/completions", self.policy)
        except netguard.UrlRefused as e:
            raise JudgeError(f"judge URL refused: {e}") from None
        body: dict[str, Any] = {"model": model, "messages": messages}
        if sp is not None:
            if sp.temperature is not None:
                body["temperature"] = sp.temperature
            if sp.top_p is not None:
                body["top_p"] = sp.top_p
            if sp.max_completions_tokens is not None:
                body["max_tokens"] = sp.max_completions_tokens
            if sp.seed is not None:
                body["seed"] = sp.seed
        headers = {"content-type": "application/json", "host": target.host_header}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        try:
            with self.client.stream(
                "POST", target.connect_url, content=json.dumps(body).encode(),
                headers=headers, extensions=extensions,
            ) as r:
                raw = b""
                for chunk in r.iter_raw():
                    raw += chunk
                    if len(raw) > MAX_RESPONSE_BYTES:
                        raise JudgeError(f"the judge answered more than {MAX_RESPONSE_BYTES} bytes")
                if r.status_code != 200:
                    raise JudgeError(f"the judge answered HTTP {r.status_code}")
        except httpx.HTTPError as e:
            raise JudgeError(f"calling the judge failed: {type(e).__name__}: {e}") from None
        try:
            content = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise JudgeError("the judge's answer is not a chat completion") from None
        return str(content)


def parse_score(content: str) -> float:
    try:
        obj = json.loads(content)
    except ValueError:
        obj = None
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        return float(obj)
    if isinstance(obj, dict):
        for key in ("score", "result", "reward"):
            v = obj.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
    m = NUMBER.search(content)
    if m is None:
        raise JudgeError(f"no score in the judge's answer: {content[:200]!r}")
    return float(m.group(0))
