"""verl's real `TrainingWorker.train_mini_batch`, run on `HacpoTrainingWorker` with only the
engine and the per-mini-batch `train_batch` underneath replaced, for the tests that check
what it does with mini-batches (update index m) and with their metrics."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu


def run_train_mini_batch(monkeypatch, train_batch, *, rows: int, mini_batch_size: int, epochs: int, outputs: bool):
    """Run `train_mini_batch` on `rows` rows (alternating own / cross) with `train_batch(self, data)`
    standing in for verl's; `outputs`: whether this rank returns the gathered metrics.
    Returns (the worker, its output)."""
    from verl.workers.engine_workers import TrainingWorker

    from recipe_hacpo import batch_keys as K
    from recipe_hacpo.workers.hacpo_worker import HacpoTrainingWorker

    monkeypatch.setattr(TrainingWorker, "train_batch", train_batch)
    worker = object.__new__(HacpoTrainingWorker)
    worker.engine = SimpleNamespace(
        get_data_parallel_size=lambda: 1, get_data_parallel_rank=lambda: 0,
        train_mode=lambda **_: nullcontext(), is_mp_src_rank_with_outputs=lambda: outputs,
    )
    worker.profiler = SimpleNamespace(step=lambda: None)
    data = TensorDict({K.IS_CROSS: torch.tensor([False, True] * (rows // 2))}, batch_size=[rows])
    tu.assign_non_tensor(data, mini_batch_size=mini_batch_size, epochs=epochs, seed=0, dataloader_kwargs={"shuffle": False})
    return worker, worker.train_mini_batch(data)
