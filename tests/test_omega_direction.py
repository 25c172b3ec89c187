"""ω on the learner batches of a real trainer step (spec §3): every cross row carries
ω^(src,k) = clamp(P̂_src / P̂_k) and every own row 1, read back from `trainer.learner_batch_dir`
with the tracker state saved next to the batches. A trainer that tagged cross rows with
P̂_k / P̂_src (learning more from weaker peers) fails here: the capabilities are distinct."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from verl import DataProto

from recipe_hacpo import batch_keys as K
from recipe_hacpo.exchange.retokenize import RowConverter, pack_rows

NAMES = ["strong", "middle", "weak"]
PROMPTS, G = 3, 2


def assert_omega_is_source_over_learner(step_dir: str, names: list[str]) -> None:
    """The check itself, on any saved step (also used on a real run's batches in test_e2e)."""
    tracker = torch.load(os.path.join(step_dir, "tracker.pt"))
    caps = np.maximum(np.mean(tracker["history"], axis=0), tracker["floor"])
    lo, hi = tracker["omega_clip"]
    for k, name in enumerate(names):
        b = DataProto.load_from_disk(os.path.join(step_dir, f"{name}.pkl"))
        src = b.batch[K.SOURCE].numpy()
        cross = b.batch[K.IS_CROSS].numpy()
        omega = b.batch[K.OMEGA].numpy()
        assert np.array_equal(cross, src != k)
        assert np.all(omega[~cross] == 1.0), name
        expected = np.clip(caps[src[cross]] / caps[k], lo, hi)
        assert np.allclose(omega[cross], expected, rtol=1e-6), (name, omega[cross], expected)


def _rollout(tokenizer, source: int, rewards: list[float]) -> DataProto:
    rows = PROMPTS * G
    prompts = [tokenizer.encode(f"q{p}", add_special_tokens=False) for p in range(PROMPTS) for _ in range(G)]
    responses = [tokenizer.encode(f"{source}{i}", add_special_tokens=False) for i in range(rows)]
    layout = pack_rows(prompts, responses, pad_id=tokenizer.pad_token_id, prompt_width=8, response_width=8)
    tensors = dict(layout)
    tensors.update({
        "old_log_probs": -torch.ones(rows, 8),
        K.REWARD: torch.tensor(rewards, dtype=torch.float32),
        K.SOURCE_LOG_PROB_MEAN: -torch.ones(rows),
        K.SOURCE_RESPONSE_LENGTH: layout["response_mask"].sum(-1).float(),
    })
    uid = np.array([f"step1-prompt{p}" for p in range(PROMPTS) for _ in range(G)], dtype=object)
    raw = np.empty(rows, dtype=object)
    for i, p in enumerate(prompts):
        raw[i] = [{"role": "user", "content": f"q{i // G}"}]
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid, "raw_prompt": raw})


def test_cross_rows_carry_source_over_learner_capability(tmp_path, char_tokenizer):
    from helpers.stand_in import stand_in_trainer

    t = stand_in_trainer(NAMES, rollout_n=G, trainer_keys={"learner_batch_dir": str(tmp_path)}, converters={
        (s, k): RowConverter(char_tokenizer, char_tokenizer, max_prompt_length=8, max_response_length=8)
        for s in NAMES for k in NAMES
    })
    # step mean rewards 5/6, 3/6, 1/6: three distinct capabilities, so ω ≠ 1/ω for every pair
    rewards = {"strong": [1, 1, 1, 1, 1, 0], "middle": [1, 1, 1, 0, 0, 0], "weak": [1, 0, 0, 0, 0, 0]}
    rollouts = {n: _rollout(char_tokenizer, i, [float(r) for r in rewards[n]]) for i, n in enumerate(NAMES)}
    metrics: dict = {}
    t.update_capabilities(rollouts, metrics)
    batches = t.exchange(rollouts, metrics)
    t.advantages(batches, metrics)
    t._dump_learner_batches(batches)

    step_dir = os.path.join(tmp_path, "step_1")
    assert_omega_is_source_over_learner(step_dir, NAMES)
    # the logged ω per source is the same value (learn more from the stronger peer)
    assert metrics["agent/weak/omega/strong"] == pytest.approx(5.0)
    assert metrics["agent/strong/omega/weak"] == pytest.approx(0.2)
    # the check fails on the inverted direction (the bug it guards against)
    b = DataProto.load_from_disk(os.path.join(step_dir, "weak.pkl"))
    cross = b.batch[K.IS_CROSS]
    b.batch[K.OMEGA][cross] = 1.0 / b.batch[K.OMEGA][cross]
    b.save_to_disk(os.path.join(step_dir, "weak.pkl"))
    with pytest.raises(AssertionError):
        assert_omega_is_source_over_learner(step_dir, NAMES)
    t._pool.shutdown()
