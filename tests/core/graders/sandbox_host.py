"""A process that hosts python-grader sandboxes, for the tests that start it as an ordinary
user (as the Docker image runs the API and the worker): it reads one JSON request on stdin
({"source", "limits", "calls": [[sample, item], ...]}), grades every call in one sandbox and
prints {"euid", "results": [{"score", "error"}, ...]}.

    setpriv --reuid=65534 --regid=65534 --clear-groups python -m tests.core.graders.sandbox_host
"""

from __future__ import annotations

import json
import os
import sys

from core.graders.sandbox import PythonSandbox, SandboxLimits, sandbox_refusal


def main() -> None:
    request = json.load(sys.stdin)
    refusal = sandbox_refusal()
    if refusal is not None:
        json.dump({"euid": os.geteuid(), "refusal": refusal}, sys.stdout)
        return
    results = []
    with PythonSandbox(request["source"], SandboxLimits(**request["limits"])) as sb:
        for sample, item in request["calls"]:
            r = sb.call(sample, item)
            results.append({"score": r.score, "error": r.error})
    json.dump({"euid": os.geteuid(), "results": results}, sys.stdout)


if __name__ == "__main__":
    main()
