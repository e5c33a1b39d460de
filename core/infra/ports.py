"""Networking helpers with no dependencies beyond the standard library, so the worker, the
CLI's embedded stack, testkit/, bench/ and the tests can all share them."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback TCP port free right now (the OS picks it): for a job's torch.distributed
    rendezvous, so two jobs on one machine never share the default 29500, and for the
    servers the embedded stack, the tests and the benchmarks start."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
