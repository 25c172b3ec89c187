"""The out-of-vocabulary tail of an output layer, banned wherever the policy is evaluated.

Some models' output layers have rows no tokenizer id reaches: Qwen3 has 151,936 rows for
151,669 ids (padding to a multiple of 64 and more). verl's vLLM server bans those rows when it
samples (their logits set to -inf, `monkey_patch_compute_logits` in verl's vLLM utilities), so
the engine samples from the distribution over the tokenizer's ids. verl's actor, left alone,
scores the same tokens over every row: each log-prob is off by log(1 − tail mass), about 1e-3
nat per token for a random-init Qwen3 and less for a trained one, and the engine/trainer check
(`trainer.rollout_check`) sees an engine that is not sampling the trained policy.

`ban_vocab_tail` puts the same ban on the actor's and the reference's output layer and on the
`hf` backend's, so engine, actor and reference evaluate one distribution and the ratios of the
loss stay those of the policy that sampled. A large finite value stands in for -inf: its
probability is exactly 0 in fp32 and bf16, and entropy terms stay finite (0 · -inf is NaN).
A model whose output layer has no more rows than the tokenizer has ids is left untouched.
"""

from __future__ import annotations

import torch

HOOK_ATTR = "_hacpo_vocab_tail_hook"


def tail_start(model: torch.nn.Module, tokenizer) -> int | None:
    """First banned row (= len(tokenizer)), or None when the output layer has no tail."""
    out = model.get_output_embeddings()
    if out is None or tokenizer is None:
        return None
    rows = int(out.weight.shape[0]) if getattr(out, "weight", None) is not None else int(out.out_features)
    ids = len(tokenizer)
    return ids if rows > ids else None


def ban_vocab_tail(model: torch.nn.Module, tokenizer) -> int | None:
    """Ban the output rows beyond the tokenizer's ids on `model`'s output layer (once).

    Returns the first banned row, or None when there is nothing to ban.
    """
    start = tail_start(model, tokenizer)
    out = model.get_output_embeddings()
    if start is None or getattr(out, HOOK_ATTR, None) is not None:
        return start

    def hook(_module, _inputs, logits: torch.Tensor) -> torch.Tensor:
        banned = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        banned[start:] = True
        # a quarter of the dtype's lowest value: survives division by a sampling temperature
        return logits.masked_fill(banned, torch.finfo(logits.dtype).min / 4)

    setattr(out, HOOK_ATTR, out.register_forward_hook(hook))
    return start
