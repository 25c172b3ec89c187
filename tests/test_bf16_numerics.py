"""The HACPO, GRAFT and SGT losses take bf16 log-probs (what verl hands the loss when the model
computes in bf16) and accumulate in float32: fed the same bf16-representable values once as bf16
and once as float32, value and metrics are equal and the bf16 gradient is the float32 one rounded
to bf16. Rows of 600-2000 tokens, where a bf16 token count is already off by several tokens and a
bf16 mean of the log-probs moves the sequence ratio.

Negative control: the same arithmetic done in bf16 (what the losses did before) is measurably off
on the same inputs, so the equality below is not a property of the data."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from recipe_hacpo import batch_keys as K
from recipe_hacpo.methods.core_algos import accumulation_dtype, hacpo_policy_loss_matrix, seq_mean_token_mean
from recipe_hacpo.methods.graft_formulas import compute_graft_policy_loss, token_mean
from recipe_hacpo.hacpo_settings import HacpoSettings
from recipe_hacpo.methods.sgt_formulas import compute_sgt_loss

BF16, F32 = torch.bfloat16, torch.float32
B, T = 12, 2048


def _inputs(seed: int = 0):
    """bf16-representable log-probs, old log-probs near them, long masks, cross rows, ω, A."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(600, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    lp = (-torch.empty(B, T).exponential_(2.5, generator=g).clamp(max=20)) * mask
    lp = lp.to(BF16).to(F32)  # representable in bf16: only the arithmetic differs below
    old = (lp + 1e-3 * torch.randn(B, T, generator=g)) * mask
    is_cross = torch.arange(B) % 2 == 1
    src = (lp * mask).sum(-1) / mask.sum(-1) + 0.05 * torch.randn(B, generator=g)
    omega = torch.where(is_cross, torch.full((B,), 1.37), torch.ones(B))
    adv = torch.randn(B, generator=g)
    return lp, old, mask, is_cross, src, omega, adv, lengths


def _bf16_and_fp32(loss_fn, lp):
    """loss_fn(x) on x = lp as bf16 and as float32 leaves; (value, metrics, grad) of each."""
    out = {}
    for name, dt in (("bf16", BF16), ("fp32", F32)):
        x = lp.detach().clone().to(dt).requires_grad_(True)
        loss, metrics = loss_fn(x)
        loss.backward()
        out[name] = (loss.detach(), metrics, x.grad)
    return out


def _assert_fp32_accumulation(out):
    (v16, m16, g16), (v32, m32, g32) = out["bf16"], out["fp32"]
    assert v16.dtype == F32  # the loss itself comes back in float32
    assert torch.equal(v16, v32), (float(v16), float(v32))
    assert m16 == m32
    assert g16.dtype == BF16
    assert torch.equal(g16, g32.to(BF16))  # the float32 gradient, rounded once at the end


def test_accumulation_dtype():
    assert accumulation_dtype(BF16) == F32
    assert accumulation_dtype(torch.float16) == F32
    assert accumulation_dtype(F32) == F32
    assert accumulation_dtype(torch.float64) == torch.float64


@pytest.mark.parametrize("cross_ratio_length", ["each", "source"])
def test_hacpo_loss_bf16_equals_fp32(cross_ratio_length):
    lp, old, mask, is_cross, src, omega, adv, lengths = _inputs()
    src_len = (lengths.float() * 1.1).round()  # another tokenizer's count

    def loss_fn(x):
        mat, metrics = hacpo_policy_loss_matrix(
            x, old, adv, mask, is_cross=is_cross, omega=omega, source_log_prob_mean=src, update_index=1,
            alpha=1.0, delta=0.2, delta_step=0.025, cross_ratio_length=cross_ratio_length,
            source_response_length=src_len,
        )
        assert mat.dtype == F32
        return seq_mean_token_mean(mat, mask), metrics

    out = _bf16_and_fp32(loss_fn, lp)
    _assert_fp32_accumulation(out)
    assert out["fp32"][1]["hacpo/cross_frac"] == 0.5  # cross rows are in the loss


def test_graft_loss_bf16_equals_fp32():
    lp, old, mask, is_cross, _, _, adv, _ = _inputs(1)
    weight = torch.where(is_cross, torch.full((B,), 0.83), torch.ones(B))
    for level in ("token", "sequence"):
        out = _bf16_and_fp32(
            lambda x: compute_graft_policy_loss(x, old, adv, mask, weight=weight, is_grafted=is_cross,
                                                clip_ratio_c=3.0, ratio_level=level),
            lp,
        )
        _assert_fp32_accumulation(out)


def test_sgt_loss_bf16_equals_fp32():
    lp, old, mask, is_cross, _, _, adv, _ = _inputs(2)
    own = mask & ~is_cross.unsqueeze(-1)
    imitated = mask & is_cross.unsqueeze(-1)
    out = _bf16_and_fp32(lambda x: compute_sgt_loss(x, old, adv, own, imitated, coef=0.1, clip_ratio_c=3.0), lp)
    _assert_fp32_accumulation(out)
    assert out["fp32"][1]["sgt/nll"] > 0


def test_negative_control_bf16_arithmetic_is_off():
    """What bf16 accumulation gives on these inputs: token counts and the cross ratio move."""
    lp, _, mask, is_cross, src, _, _, _ = _inputs()
    counts16 = mask.to(BF16).sum(-1).float()
    assert (counts16 - mask.sum(-1).float()).abs().max() >= 2
    mean16 = (lp.to(BF16) * mask.to(BF16)).sum(-1) / mask.to(BF16).sum(-1)
    mean32 = (lp * mask).sum(-1) / mask.sum(-1)
    ratio16 = (mean16.float() - src).exp()[is_cross]
    ratio32 = (mean32 - src).exp()[is_cross]
    assert (ratio16 - ratio32).abs().max() > 5e-4  # wider than GSPO's default clip_ratio_low of 3e-4
    # and a bf16 token-mean over the batch is off from the float32 one (token_mean no longer does this)
    bf16_token_mean = (lp.to(BF16) * mask).sum() / mask.to(BF16).sum()
    assert abs(bf16_token_mean.item() - token_mean(lp.to(BF16), mask).item()) > 1e-4


# --------------------------------------------------------------------------- the worker losses
def _worker_micro_batch(lp, old, mask, is_cross, src, omega, adv, own_only: bool):
    """One micro-batch in verl's no-padding layout with every field the three worker losses read."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu

    from recipe_hacpo.training.agent_runtime import worker_tensordict
    from recipe_hacpo.exchange.retokenize import pack_rows

    lengths = mask.sum(-1).tolist()
    responses = [[7 + (i + t) % 50 for t in range(n)] for i, n in enumerate(lengths)]
    layout = pack_rows([[3, 4]] * B, responses, pad_id=0, prompt_width=2, response_width=T)
    assert torch.equal(layout["response_mask"].bool(), mask)
    tensors = dict(layout)
    if own_only:  # SGT: the imitation slots are not in response_mask
        tensors["response_mask"] = layout["response_mask"] * ~is_cross.unsqueeze(-1)
    tensors.update({
        "old_log_probs": old, "advantages": adv.unsqueeze(-1) * mask,
        K.IS_CROSS: is_cross, K.OMEGA: omega, K.SOURCE_LOG_PROB_MEAN: src,
        K.GRAFT_WEIGHT: torch.where(is_cross, torch.full((B,), 0.83), torch.ones(B)),
        K.IMITATION_MASK: mask & is_cross.unsqueeze(-1),
    })
    td = worker_tensordict(DataProto.from_dict(tensors=tensors))
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=B,
                         **{K.UPDATE_INDEX: 1, K.IMITATION_TOKENS: int((mask & is_cross.unsqueeze(-1)).sum())})
    # the no-padding layout of the log-probs: each row's prompt and response tokens, in order
    seq_mask = torch.cat([layout["attention_mask"][:, :2].bool(), mask], dim=-1)
    full = torch.cat([torch.zeros(B, 2), lp], dim=-1)
    return td, full[seq_mask]


@pytest.mark.parametrize("loss_name", ["hacpo_actor_loss", "graft_actor_loss", "sgt_actor_loss"])
def test_worker_losses_bf16_equal_fp32(loss_name):
    from recipe_hacpo.methods import method_for
    from recipe_hacpo.methods.objective import actor_loss

    lp, old, mask, is_cross, src, omega, adv, _ = _inputs(3)
    td, flat = _worker_micro_batch(lp, old, mask, is_cross, src, omega, adv, own_only=loss_name == "sgt_actor_loss")
    config = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=3e-4, clip_ratio_high=4e-4, clip_ratio_c=3.0,
                             use_kl_loss=False, entropy_coeff=0.0, loss_scale_factor=None)
    hacpo = HacpoSettings(mode={"hacpo_actor_loss": "hacpo", "graft_actor_loss": "graft",
                                "sgt_actor_loss": "sgt"}[loss_name])
    objective = method_for(hacpo.mode).objective

    def loss_fn(x):
        total, metrics = actor_loss(objective, config, hacpo, {"log_probs": x}, td)
        return total, {k: (m.values if hasattr(m, "values") else m) for k, m in metrics.items()}

    out = _bf16_and_fp32(loss_fn, flat)
    (v16, m16, g16), (v32, m32, g32) = out["bf16"], out["fp32"]
    assert v16.dtype == F32
    assert torch.equal(v16, v32), (float(v16), float(v32))
    assert str(m16) == str(m32)
    assert torch.equal(g16, g32.to(BF16))
    assert g32.abs().sum() > 0
