"""score_model graders against a real (tiny) OpenAI-compatible chat endpoint started here,
and the address guard that decides which judge URLs may be called."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from core.graders.config import GraderRuntime
from core.graders.run import Grading
from core.spec.graders import parse_grader

JUDGE = {"type": "score_model", "name": "judge", "model": "judge-1", "range": [0, 10],
         "input": [{"role": "system", "content": "Score 0-10."},
                   {"role": "user", "content": "Q: {{item.question}} A: {{sample.output_text}}"}],
         "sampling_params": {"temperature": 0.0, "max_completions_tokens": 8}}


class Endpoint:
    """Answers /v1/chat/completions with the number given for the answer text."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.scores = {"Paris": "9", "Lyon": '{"score": 4}', "Mars": "I refuse."}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.requests.append({"path": self.path, "auth": self.headers.get("authorization"),
                                       "body": body})
                answer = body["messages"][-1]["content"].rsplit("A: ", 1)[1]
                data = json.dumps({"choices": [{"message": {
                    "role": "assistant", "content": outer.scores.get(answer, "12")}}]}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    e = Endpoint()
    yield e
    e.server.shutdown()
    e.server.server_close()


def runtime(url: str, **over: Any) -> GraderRuntime:
    return GraderRuntime(judge_url=url, judge_allow_http=True,
                         judge_allowed_networks=["127.0.0.1/32"], **over)


def test_the_judges_score_is_rescaled_from_its_range(
    endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FTUNE_GRADER_JUDGE_API_KEY", "sk-judge")
    with Grading(parse_grader(JUDGE), runtime(endpoint.url)) as g:
        paris = g.grade("Paris", {"question": "Capital of France?"})
        lyon = g.grade("Lyon", {"question": "Capital of France?"})
    assert paris.reward == pytest.approx(0.9) and lyon.reward == pytest.approx(0.4)
    sent = endpoint.requests[0]
    assert sent["path"] == "/v1/chat/completions" and sent["auth"] == "Bearer sk-judge"
    assert sent["body"]["model"] == "judge-1" and sent["body"]["max_tokens"] == 8
    assert sent["body"]["messages"][1]["content"] == "Q: Capital of France? A: Paris"


def test_no_score_or_one_out_of_range_is_an_error_not_a_zero(endpoint: Endpoint) -> None:
    with Grading(parse_grader(JUDGE), runtime(endpoint.url)) as g:
        refused = g.grade("Mars", {"question": "q"})
        too_high = g.grade("Venus", {"question": "q"})
        stats = g.stats.as_dict()["judge"]
    assert "no score in the judge's answer" in refused.errors["judge"]
    assert "outside [0, 1]" in too_high.errors["judge"]
    assert stats["errors"] == 1 and stats["out_of_range"] == 1


def test_a_loopback_judge_is_refused_unless_the_operator_allows_it(endpoint: Endpoint) -> None:
    guarded = GraderRuntime(judge_url=endpoint.url, judge_allow_http=True)
    with Grading(parse_grader(JUDGE), guarded) as g:
        s = g.grade("Paris", {"question": "q"})
    assert "judge URL refused" in s.errors["judge"] and "loopback" in s.errors["judge"]
    assert endpoint.requests == []
