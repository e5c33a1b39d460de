"""The grading process: graders run beside the trainer, not inside it.

The worker starts one per GRPO run (``python -m core.run.grading_process SOCKET PLAN``) before the
trainer, and stops it with the run. It holds what the trainer must not: the judge endpoint's
key (FTUNE_GRADER_JUDGE_API_KEY, in its environment only) and the python graders' sandboxes.
The trainer, which runs model code (trust_remote_code) and user data, sends it answers over a
unix socket in a directory only the worker's user may enter, one batch per round trip, and
gets the scores back; the grader itself is the job's, read here from the run plan (the
trainer cannot ask for another one).

Protocol, both ways: a 4-byte big-endian length, then that many bytes of JSON.

    -> {"answers": [{"text": str, "item": {...}, "row": int | null}, ...]}
    <- {"scores": [{"reward": float, "sub_scores": {...}, "errors": {...}}, ...],
        "stats": GraderStats.as_dict()}        (this connection's counts so far)

Each connection (one per trainer rank) gets its own ``Grading``: its own sandboxes, its own
counts, so ranks never wait on each other's graders. On SystemExit in its main thread
(core/run/grading_process.py raises it on SIGTERM and SIGUSR1) it stops listening and
serves the trainers still connected until they close: a trainer that saves its checkpoint
on the same signal is not left without its rewards.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

from core.graders.config import GraderRuntime
from core.graders.run import GraderStats, Grading, Score
from core.spec.graders import Grader

SOCKET_ENV = "FTUNE_GRADING_SOCKET"  # where the trainer finds the grading process
MAX_MESSAGE_BYTES = 256 << 20
# How long a trainer waits for its grading process to listen: on SLURM both start at once
# on each node (worker/slurm/script.py), the trainer usually long after.
CONNECT_SECONDS = 120.0
_HEADER = struct.Struct(">I")


def send(sock: socket.socket, body: dict[str, Any]) -> None:
    data = json.dumps(body, ensure_ascii=False).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def receive(sock: socket.socket) -> dict[str, Any] | None:
    """One message, or None when the peer closed the connection between messages."""
    header = _read(sock, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {size} bytes is over the limit")
    data = _read(sock, size)
    if data is None:
        raise ConnectionError("connection closed inside a message")
    body = json.loads(data)
    if not isinstance(body, dict):
        raise TypeError("a message must be a JSON object")
    return body


def _read(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            if left == n:
                return None
            raise ConnectionError("connection closed inside a message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def score_dict(s: Score) -> dict[str, Any]:
    return {"reward": s.reward, "sub_scores": s.sub_scores, "errors": s.errors}


def _serve_connection(conn: socket.socket, grader: Grader, runtime: GraderRuntime) -> None:
    with conn, Grading(grader, runtime) as grading:
        while True:
            request = receive(conn)
            if request is None:
                return
            scores = [grading.grade(str(a["text"]), dict(a["item"]), a.get("row"))
                      for a in request["answers"]]
            send(conn, {"scores": [score_dict(s) for s in scores],
                        "stats": grading.stats.as_dict()})


def serve(socket_path: Path, grader: Grader, runtime: GraderRuntime,
          ready: threading.Event | None = None, stop: threading.Event | None = None) -> None:
    """Answer every connection on ``socket_path`` until ``stop`` is set (the process's
    SIGTERM or SIGUSR1, core/run/grading_process.py) or the process is killed: then no new
    connection, and the open ones are served to their end."""
    stop = stop or threading.Event()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Bound and listening under another name first: the socket appears, under its name,
    # only once it accepts (the worker waits for it to appear).
    bound = socket_path.with_name(socket_path.name + ".tmp")
    bound.unlink(missing_ok=True)  # left by one that was killed
    server.bind(str(bound))
    os.chmod(bound, 0o600)
    server.listen()
    os.replace(bound, socket_path)
    if ready is not None:
        ready.set()
    # The stop is a flag read between accepts, not an exception raised by the signal
    # handler: one raised wherever the main thread was could land between accept() and
    # the bookkeeping of the connection's thread, which then went unjoined and died with the
    # process mid-conversation (a trainer's next batch got BrokenPipeError, in 2 full runs).
    # accept() wakes each fifth of a second to read it.
    server.settimeout(0.2)
    connections: list[threading.Thread] = []
    try:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            t = threading.Thread(target=_serve_connection, args=(conn, grader, runtime),
                                 daemon=True)
            t.start()
            connections = [c for c in connections if c.is_alive()] + [t]
    finally:
        server.close()
        socket_path.unlink(missing_ok=True)
        for t in connections:
            t.join()


class RemoteGrading:
    """The trainer's side: grades batches of answers in the grading process."""

    def __init__(self, socket_path: str, wait_seconds: float = CONNECT_SECONDS) -> None:
        self._sock = _connect(socket_path, wait_seconds)
        self.stats = GraderStats()

    def grade_batch(self, answers: list[tuple[str, dict[str, Any], int | None]]) -> list[Score]:
        send(self._sock, {"answers": [{"text": t, "item": i, "row": r} for t, i, r in answers]})
        reply = receive(self._sock)
        if reply is None:
            raise ConnectionError("the grading process closed the connection")
        self.stats = GraderStats.from_dict(reply["stats"])
        return [Score(float(s["reward"]), dict(s["sub_scores"]), dict(s["errors"]))
                for s in reply["scores"]]

    def close(self) -> None:
        self._sock.close()


def _connect(socket_path: str, wait_seconds: float) -> socket.socket:
    """Connected to the grading process, once it listens (at most ``wait_seconds``)."""
    deadline = time.monotonic() + wait_seconds
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(socket_path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError) as e:
            sock.close()
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"no grading process listens at {socket_path} after {wait_seconds:g} s "
                    "(its log: grading.log, on SLURM grading-<node>.log, in the job "
                    "directory)") from e
            time.sleep(0.1)
