"""Update order of a learner batch (spec §5): every mini-batch on every data-parallel rank
holds whole prompt groups with own and cross rows, reproducibly from the seed."""

from __future__ import annotations

import numpy as np
import pytest

from recipe_hacpo.methods.minibatch import mini_batch_order


def _learner_batch(prompts: int, own: int, cross: int):
    """[own rows; cross rows], each block prompt-major as the trainer builds it."""
    uid = [f"p{p}" for p in range(prompts) for _ in range(own)] + [f"p{p}" for p in range(prompts) for _ in range(cross)]
    is_cross = [False] * (prompts * own) + [True] * (prompts * cross)
    return np.array(uid, dtype=object), np.array(is_cross)


def _verl_slots(rows: np.ndarray, mini_rows: int, dp: int) -> list[list[np.ndarray]]:
    """verl 0.9.1 without shuffle: contiguous chunk per rank, contiguous mini-batches in it."""
    chunks = np.split(rows, dp)
    return [np.split(chunk, len(chunk) // (mini_rows // dp)) for chunk in chunks]


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("prompts, mini, own, cross", [(8, 4, 2, 2), (16, 4, 3, 5), (128, 32, 8, 8)])
def test_every_slot_holds_whole_groups_of_both_kinds(dp, prompts, mini, own, cross):
    uid, is_cross = _learner_batch(prompts, own, cross)
    order = mini_batch_order(uid, is_cross, mini_batch_prompts=mini, dp_size=dp, seed=42)
    assert sorted(order.tolist()) == list(range(len(uid)))  # a permutation
    seen = set()
    for rank_slots in _verl_slots(order, mini * (own + cross), dp):
        assert len(rank_slots) == prompts // mini  # updates per step
        for slot in rank_slots:
            groups = set(uid[slot])
            assert len(groups) == mini // dp
            assert not groups & seen  # a prompt lives in one slot only
            seen |= groups
            for g in groups:  # whole groups: all own and all cross rows of the prompt
                rows = slot[uid[slot] == g]
                assert (~is_cross[rows]).sum() == own and is_cross[rows].sum() == cross
    assert len(seen) == prompts


def test_order_is_reproducible_from_the_seed():
    uid, is_cross = _learner_batch(16, 2, 2)
    a = mini_batch_order(uid, is_cross, mini_batch_prompts=4, dp_size=2, seed=7)
    b = mini_batch_order(uid.copy(), is_cross.copy(), mini_batch_prompts=4, dp_size=2, seed=7)
    c = mini_batch_order(uid, is_cross, mini_batch_prompts=4, dp_size=2, seed=8)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_bad_shapes_are_rejected():
    uid, is_cross = _learner_batch(8, 2, 2)
    with pytest.raises(ValueError, match="8 prompts do not split into mini-batches of 3"):
        mini_batch_order(uid, is_cross, mini_batch_prompts=3, dp_size=1, seed=0)
    with pytest.raises(ValueError, match="over 4 data-parallel ranks"):
        mini_batch_order(uid, is_cross, mini_batch_prompts=2, dp_size=4, seed=0)
    with pytest.raises(ValueError, match="different sizes"):
        mini_batch_order(uid[:-1], is_cross[:-1], mini_batch_prompts=4, dp_size=1, seed=0)
