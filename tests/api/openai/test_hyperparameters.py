"""The documented rules that resolve OpenAI's "auto" hyperparameters."""

from __future__ import annotations

import pytest

from api.openai.hyperparameters import auto_batch_size, auto_n_epochs, split_batch


@pytest.mark.parametrize(("rows", "epochs"), [(10, 10), (2, 25), (34, 3), (1000, 3),
                                              (10_000, 2), (100_000, 1)])
def test_auto_epochs_train_between_100_and_25000_examples(rows: int, epochs: int) -> None:
    assert auto_n_epochs(rows) == epochs


@pytest.mark.parametrize(("rows", "batch"), [(8, 1), (1000, 2), (50_000, 100),
                                             (1_000_000, 256)])
def test_auto_batch_is_a_fifth_of_a_percent_of_the_rows(rows: int, batch: int) -> None:
    assert auto_batch_size(rows) == batch


@pytest.mark.parametrize(("batch", "processes", "micro", "accumulation"),
                         [(4, 1, 4, 1), (32, 1, 8, 4), (7, 1, 7, 1), (11, 1, 1, 11),
                          (32, 2, 8, 2), (6, 4, 2, 1)])
def test_a_batch_splits_into_micro_batches_and_accumulation(
        batch: int, processes: int, micro: int, accumulation: int) -> None:
    split = split_batch(batch, processes)
    assert (split.per_device, split.accumulation) == (micro, accumulation)
    assert split.effective(processes) >= batch
