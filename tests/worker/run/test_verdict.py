"""worker.run.verdict: the status, error code and message a finished run gets, from its evidence
alone (no process, file or database)."""

from __future__ import annotations

from core.infra.errors import ErrorCode
from core.jobs.state import StopReason
from worker.run.verdict import REQUEUE, Evidence, Verdict, decide


def test_exit_zero_with_a_verified_adapter_succeeds() -> None:
    assert decide(Evidence(0, adapter_present=True)) == Verdict("succeeded")


def test_a_verified_adapter_wins_over_a_late_cancel_or_deadline() -> None:
    late = Evidence(0, adapter_present=True, cancel_requested=True, deadline_passed=True)
    assert decide(late).status == "succeeded"


def test_exit_zero_without_an_adapter_is_trainer_crashed_with_the_log() -> None:
    v = decide(Evidence(0))
    assert (v.status, v.code, v.message) == (
        "failed", ErrorCode.trainer_crashed, "trainer exited 0 without an adapter"
    )
    assert v.show_log and not v.log_in_message


def test_exit_zero_with_an_unusable_adapter_is_adapter_invalid() -> None:
    v = decide(Evidence(0, adapter_present=True, adapter_problem="every adapter weight is zero"))
    assert (v.status, v.code) == ("failed", ErrorCode.adapter_invalid)
    assert v.message == "the trainer's adapter is unusable: every adapter weight is zero"
    assert not v.show_log


def test_non_zero_with_error_json_reports_its_code_and_message() -> None:
    err = {"code": "invalid_dataset", "message": "row 3: empty text", "traceback": "Trace..."}
    v = decide(Evidence(1, error=err))
    assert (v.status, v.code, v.message) == ("failed", ErrorCode.invalid_dataset,
                                             "row 3: empty text")
    assert v.show_log and not v.log_in_message and v.traceback == "Trace..."


def test_out_of_memory_as_the_trainer_classified_it() -> None:
    v = decide(Evidence(1, error={"code": "out_of_memory", "message": "CUDA OOM at step 3"}))
    assert (v.code, v.message) == (ErrorCode.out_of_memory, "CUDA OOM at step 3")


def test_an_unknown_code_in_error_json_is_trainer_crashed() -> None:
    v = decide(Evidence(1, error={"code": "made_up", "message": "m"}))
    assert (v.code, v.message) == (ErrorCode.trainer_crashed, "m")


def test_non_zero_without_error_json_is_trainer_crashed_with_the_log_in_the_message() -> None:
    v = decide(Evidence(-9))
    assert (v.status, v.code, v.message) == ("failed", ErrorCode.trainer_crashed,
                                             "trainer exited with code -9")
    assert v.show_log and v.log_in_message


def test_without_error_json_the_rank_that_failed_first_is_named() -> None:
    v = decide(Evidence(1, root_cause=(1, -9)))
    assert v.message == "rank 1 failed first (exit code -9): trainer exited with code 1"
    assert v.code == ErrorCode.trainer_crashed


def test_error_json_of_a_rank_that_failed_second_names_the_first() -> None:
    err = {"code": "trainer_crashed", "message": "peer vanished", "rank": 0}
    v = decide(Evidence(1, error=err, root_cause=(1, -9)))
    assert v.message == ("rank 1 failed first (exit code -9; see the log); "
                         "then rank 0: peer vanished")


def test_error_json_of_the_rank_that_failed_first_is_reported_as_is() -> None:
    err = {"code": "nan_loss", "message": "diverged", "rank": 1}
    assert decide(Evidence(1, error=err, root_cause=(1, 1))).message == "diverged"


def test_a_cancel_the_watch_enforced_is_cancelled() -> None:
    assert decide(Evidence(-15, stop_reason=StopReason.cancel)) == Verdict("cancelled")


def test_a_cancel_requested_as_the_trainer_failed_is_cancelled() -> None:
    assert decide(Evidence(1, error={"code": "out_of_memory"}, cancel_requested=True)) == (
        Verdict("cancelled")
    )


def test_the_deadline_the_watch_enforced_is_timeout() -> None:
    v = decide(Evidence(-15, stop_reason=StopReason.timeout, timeout_seconds=6))
    assert (v.status, v.code) == ("failed", ErrorCode.timeout)
    assert v.message == "the job ran past its time limit of 6 s"


def test_a_deadline_that_passed_as_the_trainer_exited_is_timeout() -> None:
    v = decide(Evidence(1, deadline_passed=True, timeout_seconds=60))
    assert (v.code, v.message) == (ErrorCode.timeout, "the job ran past its time limit of 60 s")


def test_a_worker_shutdown_requeues() -> None:
    v = decide(Evidence(-15, stop_reason=StopReason.shutdown))
    assert (v.status, v.message) == (REQUEUE, "the worker shut down")


# --------------------------------------------------------------------------- pause


def test_a_pause_stop_is_paused() -> None:
    assert decide(Evidence(0, stop_reason=StopReason.pause)) == Verdict("paused")


def test_a_trainer_killed_after_the_pause_grace_is_still_paused() -> None:
    assert decide(Evidence(-9, stop_reason=StopReason.pause)).status == "paused"


def test_a_run_that_finished_before_the_pause_took_effect_succeeded() -> None:
    assert decide(Evidence(0, stop_reason=StopReason.pause, adapter_present=True)).status == "succeeded"


def test_a_cancel_during_a_pause_wins() -> None:
    assert decide(Evidence(0, stop_reason=StopReason.pause, cancel_requested=True)).status == "cancelled"


def test_a_trainer_failure_during_a_pause_is_reported() -> None:
    err = {"code": "out_of_memory", "message": "CUDA out of memory"}
    v = decide(Evidence(1, stop_reason=StopReason.pause, error=err))
    assert (v.status, v.code, v.message) == ("failed", ErrorCode.out_of_memory,
                                             "CUDA out of memory")
