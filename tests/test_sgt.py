"""SGT (`algorithm.hacpo.mode=sgt`, docs/ALGORITHM.md §9) without Ray: the selection (receiver
all wrong and a peer right, N = 3 pooling, a draw fixed by seed, step and uid), the loss's value
and gradient by hand, its equality to GRAFT with nothing exchanged (= verl's GRPO), the worker
loss over micro-batches against the core formula, the trainer's learner batches (one imitation
slot per prompt group), and the config."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.verl_losses import verl_vanilla_loss as _verl_vanilla

from recipe_hacpo import batch_keys as K
from recipe_hacpo.methods.graft_formulas import compute_graft_policy_loss, grpo_advantage
from recipe_hacpo.hacpo_settings import ConfigError, HacpoSettings
from recipe_hacpo.methods.sgt_formulas import compute_sgt_loss, imitation_nll, sgt_draw, sgt_selection
from helpers.compose import compose_config

F64 = torch.float64


# --------------------------------------------------------------------------- selection
def _two_agents():
    """n = 2 each, rows pooled agent A (rows 0-7) then agent B (rows 8-15), two rows per prompt.

    k_A = [0, 1, 0, 0], k_B = [2, 0, 0, 1] over q0..q3.
    """
    index = np.array([f"q{q}" for q in range(4) for _ in range(2)] * 2)
    source = torch.tensor([0] * 8 + [1] * 8)
    correct = torch.tensor([0, 0, 1, 0, 0, 0, 0, 0] + [1, 1, 0, 0, 0, 0, 0, 1], dtype=torch.bool)
    return correct, index, source


def test_selection_two_agents_by_hand():
    correct, index, source = _two_agents()
    uids, a = sgt_selection(correct, index, source, 0, seed=7, step=3)
    assert uids == ["q0", "q1", "q2", "q3"]
    # A: q0 failed and B has rows 8, 9 correct → one of them; q1 A solved; q2 nobody right;
    # q3 failed and B's only correct row is 15
    assert a[0] in (8, 9) and a[1:].tolist() == [-1, -1, 15]
    _, b = sgt_selection(correct, index, source, 1, seed=7, step=3)
    # B: q1 failed, A's row 2 is the only correct one; q0 and q3 B solved; q2 nobody
    assert b.tolist() == [-1, 2, -1, -1]


def test_no_imitation_when_the_receiver_has_a_correct_row():
    correct, index, source = _two_agents()
    correct[0] = True  # A now solved q0 once: nothing to imitate there, whatever B did
    _, a = sgt_selection(correct, index, source, 0, seed=7, step=3)
    assert a.tolist() == [-1, -1, -1, 15]


def test_three_agents_pool_every_peers_correct_rows_and_draw_uniformly():
    # one prompt: receiver 0 rows 0-1 wrong, peer 1 row 3 right, peer 2 rows 4, 5 right
    index = np.array(["q"] * 6)
    source = torch.tensor([0, 0, 1, 1, 2, 2])
    correct = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.bool)
    counts = {3: 0, 4: 0, 5: 0}
    for step in range(600):
        _, pick = sgt_selection(correct, index, source, 0, seed=0, step=step)
        counts[int(pick[0])] += 1
    # each correct response 1/3 (not each peer 1/2): binomial(600, 1/3) has σ ≈ 11.5, so 140..260 is > 5σ
    assert all(140 <= c <= 260 for c in counts.values()), counts
    # peer 2 as receiver pools peers 0 (nothing right) and 1 (row 3)... but peer 2 itself solved q
    assert sgt_selection(correct, index, source, 2, seed=0, step=0)[1].tolist() == [-1]


def test_draw_is_fixed_by_seed_step_uid_and_receiver_only():
    key = dict(seed=42, step=5, uid="step5-prompt3", receiver=1)
    first = [sgt_draw(n, **key) for n in range(1, 30)]
    torch.manual_seed(123)
    np.random.seed(321)
    torch.rand(10), np.random.rand(10)  # global random state moved: the draw does not read it
    assert [sgt_draw(n, **key) for n in range(1, 30)] == first
    assert all(0 <= j < n for n, j in zip(range(1, 30), first))
    # each of seed, step, uid and receiver changes the draw somewhere over 29 pool sizes
    for change in (dict(seed=43), dict(step=6), dict(uid="step5-prompt4"), dict(receiver=0)):
        assert [sgt_draw(n, **{**key, **change}) for n in range(1, 30)] != first, change
    with pytest.raises(ValueError, match="empty"):
        sgt_draw(0, **key)


def test_selection_does_not_depend_on_the_order_of_calls():
    correct, index, source = _two_agents()
    index = np.array([f"step9-{u}" for u in index])
    # the draw of q0 over 50 steps: a resumed run (a fresh process) recomputes exactly these
    once = [int(sgt_selection(correct, index, source, 0, seed=1, step=s)[1][0]) for s in range(50)]
    again = [int(sgt_selection(correct, index, source, 0, seed=1, step=s)[1][0]) for s in reversed(range(50))]
    assert once == again[::-1]
    assert set(once) == {8, 9}


# --------------------------------------------------------------------------- the loss
def _hand_case():
    """Row 0 own (Â = 1, ρ = 1); row 1 own (Â = 1, ρ = 1.5 on its one token: clipped at 1.28);
    row 2 an imitated slot (tokens −log π = 2, 4); row 3 an empty slot (masked out everywhere)."""
    log_prob = torch.tensor(
        [[-0.5, -1.0], [-1.0 + np.log(1.5), -9.0], [-2.0, -4.0], [-7.0, -7.0]], dtype=F64, requires_grad=True
    )
    old = torch.tensor([[-0.5, -1.0], [-1.0, -1.0], [0.0, 0.0], [0.0, 0.0]], dtype=F64)
    adv = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=F64)
    response_mask = torch.tensor([[1, 1], [1, 0], [0, 0], [0, 0]])
    imitation_mask = torch.tensor([[0, 0], [0, 0], [1, 1], [0, 0]])
    return log_prob, old, adv, response_mask, imitation_mask


def test_loss_value_and_gradient_by_hand():
    log_prob, old, adv, response_mask, imitation_mask = _hand_case()
    loss, metrics = compute_sgt_loss(log_prob, old, adv, response_mask, imitation_mask, coef=0.1)
    # GRPO: token-mean over the 3 own tokens of −min(ρÂ, clip(ρ)Â) = (−1 − 1 − 1.28) / 3
    # NLL: token-mean over the 2 imitated tokens = (2 + 4) / 2 = 3;  L = −3.28/3 + 0.1 · 3
    assert loss.item() == pytest.approx(-3.28 / 3 + 0.3)
    assert metrics["actor/pg_loss"] == pytest.approx(-3.28 / 3)
    assert metrics["sgt/nll"] == pytest.approx(3.0)
    assert imitation_nll(log_prob, imitation_mask).item() == pytest.approx(3.0)
    (grad,) = torch.autograd.grad(loss, log_prob)
    # ∂/∂log π: −Â/3 on unclipped own tokens, 0 on the clipped one, −λ/2 per imitated token
    expected = [[-1 / 3, -1 / 3], [0.0, 0.0], [-0.05, -0.05], [0.0, 0.0]]
    assert grad.tolist() == [pytest.approx(r) for r in expected]


def test_loss_rejects_a_token_in_both_masks_and_a_negative_lambda():
    log_prob, old, adv, response_mask, imitation_mask = _hand_case()
    with pytest.raises(ValueError, match="both"):
        compute_sgt_loss(log_prob, old, adv, response_mask, response_mask)
    with pytest.raises(ValueError, match="λ"):
        compute_sgt_loss(log_prob, old, adv, response_mask, imitation_mask, coef=-0.1)


@pytest.mark.parametrize("scale", [0.05, 2.0])  # ratios near 1, and far outside the clip and dual clip
def test_without_imitation_the_loss_is_grafts_without_exchange_and_verls_grpo(scale):
    g = torch.Generator().manual_seed(11)
    b, t, slots = 6, 5, 3  # 6 own rows and 3 empty imitation slots
    old = -torch.rand(b + slots, t, generator=g, dtype=F64) * 3
    log_prob = (old + scale * torch.randn(b + slots, t, generator=g, dtype=F64)).requires_grad_(True)
    adv = torch.randn(b + slots, generator=g, dtype=F64).unsqueeze(-1).expand(b + slots, t)
    mask = (torch.rand(b + slots, t, generator=g) > 0.3).long()
    mask[:, 0] = 1
    mask[b:] = 0  # the slots: in neither term
    ours, _ = compute_sgt_loss(log_prob, old, adv, mask, torch.zeros_like(mask), clip_ratio_c=3.0)
    own = slice(0, b)
    graft, _ = compute_graft_policy_loss(
        log_prob[own], old[own], adv[own], mask[own], weight=torch.ones(b),
        is_grafted=torch.zeros(b, dtype=torch.bool), clip_ratio_c=3.0,
    )
    (verl, _), dual = _verl_vanilla(log_prob[own], old[own], adv[own], mask[own], 0.2, 0.28)
    assert dual == 3.0
    grads = [torch.autograd.grad(x, log_prob, retain_graph=True)[0] for x in (ours, graft, verl)]
    assert torch.allclose(ours, graft, atol=1e-12) and torch.allclose(ours, verl, atol=1e-12)
    assert torch.allclose(grads[0], grads[1], atol=1e-12) and torch.allclose(grads[0], grads[2], atol=1e-12)
    assert not grads[0][b:].any()  # nothing reaches the slots


# --------------------------------------------------------------------------- the worker loss
def _micro_batch(rows: list[tuple[list[int], list[int]]], own_tokens: int, imitation_tokens: int, g):
    """One micro-batch as verl's engine hands it to the loss (no-padding layout, global counts)."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu

    from recipe_hacpo.training.agent_runtime import worker_tensordict
    from recipe_hacpo.exchange.retokenize import pack_rows

    layout = pack_rows([p for p, _ in rows], [r for _, r in rows], pad_id=0, prompt_width=4, response_width=3)
    n = len(rows)
    mask = layout["response_mask"]
    slot = torch.tensor([i % 3 == 2 for i in range(n)])  # every third row is its prompt's slot
    imitated = slot & torch.tensor([i % 6 == 2 for i in range(n)])  # half the slots imitate
    tensors = dict(layout)
    tensors.update({
        "response_mask": mask * ~slot.unsqueeze(-1),
        K.IMITATION_MASK: mask * imitated.unsqueeze(-1),
        "old_log_probs": -torch.rand(mask.shape, generator=g, dtype=torch.float64),
        "advantages": torch.randn(n, 1, generator=g, dtype=torch.float64) * mask * ~slot.unsqueeze(-1),
        K.IS_CROSS: slot,
    })
    td = worker_tensordict(DataProto.from_dict(tensors=tensors))
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=own_tokens, global_batch_size=12,
                         **{K.UPDATE_INDEX: 0, K.IMITATION_TOKENS: imitation_tokens})
    return td, tensors


def test_worker_loss_over_micro_batches_is_the_core_loss_of_the_mini_batch():
    from verl.workers.utils.padding import no_padding_2_padding

    from recipe_hacpo.methods.sgt import sgt_actor_loss

    g = torch.Generator().manual_seed(3)
    rows = [([5, 6, 7][: 1 + i % 3], [8, 9, 10][: 1 + (i * 2) % 3]) for i in range(12)]
    own_tokens = sum(len(r) for i, (_, r) in enumerate(rows) if i % 3 != 2)
    imitation_tokens = sum(len(r) for i, (_, r) in enumerate(rows) if i % 6 == 2)
    micro = [_micro_batch(half, own_tokens, imitation_tokens, g) for half in (rows[:6], rows[6:])]
    config = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                             use_kl_loss=False, entropy_coeff=0.0, loss_scale_factor=None)
    hacpo = HacpoSettings(mode="sgt", sgt_lambda=0.1)

    values = [(-torch.rand(int(td["input_ids"].offsets()[-1]), generator=g, dtype=F64)).requires_grad_(True)
              for td, _ in micro]
    worker = 0.0
    nll_sum = nll_tokens = 0.0
    for (td, _), v in zip(micro, values):
        loss, metrics = sgt_actor_loss(config, hacpo, {"log_probs": v}, td)
        worker = worker + loss
        nll_sum += metrics["sgt/nll_sum"].values[0]
        nll_tokens += metrics["sgt/nll_tokens"].values[0]
    padded = torch.cat([no_padding_2_padding(v, td) for (td, _), v in zip(micro, values)])
    field = lambda key: torch.cat([t[key] for _, t in micro])  # noqa: E731
    core, core_metrics = compute_sgt_loss(
        padded, field("old_log_probs"), field("advantages"), field("response_mask"), field(K.IMITATION_MASK),
        coef=0.1, clip_ratio_c=3.0,
    )
    assert nll_tokens == imitation_tokens > 0
    assert nll_sum / nll_tokens == pytest.approx(core_metrics["sgt/nll"])
    assert worker.item() == pytest.approx(core.item(), abs=1e-12)
    for a, b in zip(torch.autograd.grad(worker, values, retain_graph=True), torch.autograd.grad(core, values)):
        assert torch.allclose(a, b, atol=1e-12)


def test_worker_loss_needs_the_mini_batch_imitation_count():
    from verl.utils import tensordict_utils as tu

    from recipe_hacpo.methods.sgt import sgt_actor_loss

    td, _ = _micro_batch([([5], [8])] * 3, 2, 1, torch.Generator().manual_seed(0))
    td = td.exclude(K.IMITATION_TOKENS)
    assert tu.get_non_tensor_data(td, K.IMITATION_TOKENS, None) is None
    config = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                             use_kl_loss=False, entropy_coeff=0.0, loss_scale_factor=None)
    with pytest.raises(RuntimeError, match=K.IMITATION_TOKENS):
        sgt_actor_loss(config, HacpoSettings(mode="sgt"), {"log_probs": -torch.ones(6, dtype=F64)}, td)


# --------------------------------------------------------------------------- the learner batches
N, Q = 2, 4
REWARDS = {"a": [0, 0, 1, 0, 0, 0, 0, 0], "b": [1, 1, 0, 0, 0, 0, 0, 1]}  # as `_two_agents`


def _rollout(tokenizer, name: str):
    """One agent's scored rollout: Q prompts × N responses "<name><row>", own old log-probs."""
    from verl import DataProto

    from recipe_hacpo.exchange.retokenize import pack_rows

    rows = Q * N
    texts = [f"{name}{i}" for i in range(rows)]
    messages = [[{"role": "user", "content": f"{i // N} + 1 ="}] for i in range(rows)]
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in messages]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    responses = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in texts]
    layout = pack_rows(prompts, responses, pad_id=tokenizer.pad_token_id, prompt_width=32, response_width=8)
    mask = layout["response_mask"]
    tensors = dict(layout)
    tensors.update({
        "old_log_probs": -0.5 * mask.float(),
        K.REWARD: torch.tensor(REWARDS[name], dtype=torch.float32),
        K.SOURCE_LOG_PROB_MEAN: torch.full((rows,), -0.5),
        K.SOURCE_RESPONSE_LENGTH: mask.sum(-1).float(),
    })
    obj = lambda values: np.array(values, dtype=object)  # noqa: E731
    non_tensors = {
        "uid": obj([f"step3-prompt{i // N}" for i in range(rows)]),
        "raw_prompt": obj(messages),
        "data_source": obj(["arith"] * rows),
        "reward_model": obj([{"ground_truth": "0", "style": "rule"}] * rows),
        K.RESPONSE_TEXT: obj(texts),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={"temperature": 1.0})


def _context(tokenizers: dict):
    """The step context sgt_exchange reads: the agents, each agent's seed (42), the converters, step 3."""
    from helpers.stand_in import stand_in_context

    from recipe_hacpo.exchange.retokenize import RowConverter

    names = list(tokenizers)
    converters = {
        (s, l): RowConverter(tokenizers[s], tokenizers[l], max_prompt_length=32, max_response_length=8)
        for s in names for l in names
    }
    return stand_in_context(names, converters, step=3, rollout_n=N, seed=42)


def test_learner_batches_hold_own_rows_and_one_imitation_slot_per_prompt(char_tokenizer, pair_tokenizer):
    from recipe_hacpo.methods.context import prefixed
    from recipe_hacpo.methods.sgt import sgt_advantages, sgt_exchange

    tokenizers = {"a": char_tokenizer, "b": pair_tokenizer}
    batches, exchanged = sgt_exchange(_context(tokenizers), {n: _rollout(t, n) for n, t in tokenizers.items()})
    metrics = prefixed(exchanged) | prefixed(sgt_advantages(batches))
    # what each receiver imitates, by the formula on the pooled rows (A's rows, then B's)
    correct, index, source = _two_agents()
    index = np.array([f"step3-prompt{u[1]}" for u in index])
    expected = {n: sgt_selection(correct, index, source, k, seed=42, step=3)[1] for k, n in enumerate(tokenizers)}
    pooled_text = [f"a{i}" for i in range(8)] + [f"b{i}" for i in range(8)]
    for k, (name, tok) in enumerate(tokenizers.items()):
        b = batches[name]
        uid = b.non_tensor_batch["uid"]
        cross, mask, imit = b.batch[K.IS_CROSS], b.batch["response_mask"], b.batch[K.IMITATION_MASK]
        assert len(b) == Q * (N + 1)
        for q in range(Q):
            rows = torch.as_tensor(np.flatnonzero(uid == f"step3-prompt{q}"))
            own, (slot,) = rows[~cross[rows]], rows[cross[rows]].tolist()
            assert len(own) == N and not imit[own].any() and (mask[own].sum(-1) > 0).all()
            # the slot: never in GRPO's loss, advantage 0; its tokens are the NLL's iff imitated
            assert int(mask[slot].sum()) == 0 and float(b.batch["advantages"][slot].abs().sum()) == 0
            pick = int(expected[name][q])
            text = b.non_tensor_batch[K.RESPONSE_TEXT][slot]
            if pick >= 0:
                assert text == pooled_text[pick]
                n_tokens = len(tok.encode(text, add_special_tokens=False)) + 1  # re-tokenized for the receiver, + EOS
                assert int(imit[slot].sum()) == n_tokens
                assert tok.decode(b.batch["responses"][slot][imit[slot].bool()], skip_special_tokens=True) == text
            else:
                assert int(imit[slot].sum()) == 0
                assert text.startswith("b" if name == "a" else "a")  # a peer's response as placeholder
            assert int(b.batch[K.SOURCE][slot]) == (1 - k)
        # GRPO advantages of the receiver's own groups only
        own = ~cross
        adv = grpo_advantage(torch.tensor(REWARDS[name], dtype=torch.float32), np.repeat(np.arange(Q), N))
        assert torch.allclose(b.batch[K.GROUP_ADVANTAGE][own], adv.float())
        assert metrics[f"agent/{name}/sgt/prompts_imitated"] == int((expected[name] >= 0).sum())
        assert metrics[f"agent/{name}/sgt/imitation_tokens"] == int(imit.sum())
        assert metrics[f"agent/{name}/advantage/abs_mean"] == pytest.approx(float(adv.abs().mean()))
    assert metrics["agent/a/sgt/prompts_imitated"] == 2 and metrics["agent/b/sgt/prompts_imitated"] == 1


def test_learner_batches_go_through_the_mini_batch_layout(char_tokenizer):
    """Whole groups of n own rows + 1 slot in every mini-batch, the slot after its own rows."""
    from recipe_hacpo.methods.sgt import sgt_exchange
    from recipe_hacpo.methods.minibatch import mini_batch_order

    tokenizers = {"a": char_tokenizer, "b": char_tokenizer}  # same tokenizer: no decode at all
    batches, _ = sgt_exchange(_context(tokenizers), {n: _rollout(t, n) for n, t in tokenizers.items()})
    b = batches["a"]
    order = mini_batch_order(b.non_tensor_batch["uid"], b.batch[K.IS_CROSS].numpy(), mini_batch_prompts=2,
                             dp_size=1, seed=0)
    laid = b.batch[K.IS_CROSS][torch.as_tensor(order)].view(Q, N + 1)
    assert laid.tolist() == [[False] * N + [True]] * Q
    assert int(b.batch[K.IMITATION_MASK].sum()) > 0


# --------------------------------------------------------------------------- config
def _compose(overrides: list[str]):
    return compose_config("hacpo_cpu_demo", overrides)


def test_sgt_lambda_is_declared_once_with_its_default():
    assert HacpoSettings().sgt_lambda == 0.1
    assert HacpoSettings.from_dict({"mode": "sgt", "sgt_lambda": 0}).sgt_lambda == 0.0
    for bad in (-0.1, float("inf"), "x"):
        with pytest.raises(ConfigError) as err:
            HacpoSettings.from_dict({"mode": "sgt", "sgt_lambda": bad})
        assert str(err.value).startswith("algorithm.hacpo.sgt_lambda=") and "\n" not in str(err.value)


def test_mode_sgt_config_counts_one_slot_per_prompt(tiny_agent_paths):
    from recipe_hacpo.config import validate

    paths = [f"agents.qwen_char.model_path={tiny_agent_paths['qwen2-char-small']}",
             f"agents.llama_pair.model_path={tiny_agent_paths['llama-pair-medium']}"]
    # hacpo_cpu_demo: mini-batches of 4 prompts × (4 own + 1 slot) = 20 rows; micro-batches of 16 do not divide
    with pytest.raises(ConfigError) as err:
        validate(_compose(paths + ["+baseline=sgt", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]))
    assert re.search(r"ppo_micro_batch_size_per_gpu=16 does not divide the 20 rows", str(err.value)), err.value
    specs, hacpo = validate(_compose(paths + [
        "+baseline=sgt", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=10",
    ]))
    assert (hacpo.mode, hacpo.sgt_lambda) == ("sgt", 0.1)
    cfg = _compose(paths + ["+baseline=sgt"])
    assert (cfg.actor_rollout_ref.actor.clip_ratio_low, cfg.actor_rollout_ref.actor.clip_ratio_high) == (0.2, 0.28)
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 32 and cfg.actor_rollout_ref.actor.ppo_epochs == 1
