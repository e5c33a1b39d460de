"""Helpers that the tests and the benchmarks share: throwaway PostgreSQL databases (pg), a
stack whose processes can be killed on purpose (faultstack), and the fake trainer a worker
runs instead of core.train (fake_trainer, FTUNE_TRAINER_MODULE=testkit.fake_trainer), and
core.train launched on a job directory as the worker launches it (launch).

bench/ must not import from tests/, so what both need lives here. Not shipped: pyproject's
package list leaves it out, as it does tests/ and bench/.
"""
