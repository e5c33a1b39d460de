"""Benchmarks: scripts that print figures and keep a JSON record under bench/results/.

Each runs as a module from the repository root (``python -m bench.<name>``), so the
repository's packages import as they do for the service, without editing ``sys.path``.
bench/harness.py holds what they share: the tiny model, the run plan, CPU seconds.
"""
