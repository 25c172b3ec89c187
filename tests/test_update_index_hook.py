"""The update-index hook (spec §5, m) fails loudly when verl stops calling `train_batch` once
per mini-batch, instead of leaving m at one value (stepwise clipping silently fixed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.engine_workers import TrainingWorker

from recipe_hacpo import batch_keys as K
from recipe_hacpo.workers.hacpo_worker import HacpoTrainingWorker


def _worker() -> HacpoTrainingWorker:
    w = object.__new__(HacpoTrainingWorker)
    w.engine = SimpleNamespace(get_data_parallel_size=lambda: 1)
    return w


def _batch() -> TensorDict:
    td = TensorDict({K.IS_CROSS: torch.tensor([False, True] * 4)}, batch_size=[8])
    tu.assign_non_tensor(td, mini_batch_size=2, epochs=1)
    return td


def test_one_call_per_mini_batch_numbers_the_updates(monkeypatch):
    seen = []

    def verl_mini_batches(self, data):
        for i in range(4):
            self.train_batch(data[2 * i : 2 * i + 2])

    monkeypatch.setattr(TrainingWorker, "train_mini_batch", verl_mini_batches)
    monkeypatch.setattr(TrainingWorker, "train_batch", lambda self, data: seen.append(tu.get(data, K.UPDATE_INDEX)))
    w = _worker()
    w.train_mini_batch(_batch())
    assert seen == [0, 1, 2, 3]
    assert [(e["update_index"], e["own_rows"], e["cross_rows"]) for e in w.update_record] == [
        (m, 1, 1) for m in range(4)
    ]
    w.train_mini_batch(_batch())  # m restarts with every training step
    assert seen[4:] == [0, 1, 2, 3]


def test_a_verl_that_trains_the_batch_in_one_call_is_caught(monkeypatch):
    monkeypatch.setattr(TrainingWorker, "train_mini_batch", lambda self, data: self.train_batch(data))
    monkeypatch.setattr(TrainingWorker, "train_batch", lambda self, data: None)
    with pytest.raises(RuntimeError, match=r"verl ran train_batch 1 times for 4 mini-batches"):
        _worker().train_mini_batch(_batch())
