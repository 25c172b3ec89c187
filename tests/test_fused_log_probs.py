"""The CPU preset's log-prob path: verl's fused-kernel forward (torch backend) against verl's
default `logprobs_from_logits`, which on CPU loops over every token in Python.

`hacpo_cpu_demo` sets `actor_rollout_ref.model.use_fused_kernels=true` (verl's own knob, its
`fused_kernel_options.impl_backend` default `torch`), so the actor's log-probs and their
gradients come from `FusedLinearForPPO` (chunked, vectorised) instead. Both must give the same
log-probs and gradients to float tolerance on each tiny agent's architecture, at the sampling
temperature and at another one.
"""

from __future__ import annotations

import pytest
import torch

from recipe_hacpo import tiny_agents


def _fused(model):
    """`model` with verl's fused-kernel forward installed on a throwaway subclass of its class
    (verl patches the class; the subclass keeps the patch away from every other test)."""
    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    model.__class__ = type(f"Fused{type(model).__name__}", (type(model),), {})
    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
    assert type(model).forward is not type(model).__mro__[1].forward, "verl did not install its fused forward"
    return model


def _inputs(tokenizer, rows: int = 6, width: int = 20, seed: int = 0):
    """Right-padded rows of random lengths (the layout verl's engine feeds the model without rmpad)."""
    g = torch.Generator().manual_seed(seed)
    vocab = torch.tensor([i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids])
    lengths = torch.randint(5, width + 1, (rows,), generator=g)
    input_ids = torch.full((rows, width), tokenizer.pad_token_id)
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    input_ids[mask] = vocab[torch.randint(len(vocab), (int(mask.sum()),), generator=g)]
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return input_ids, mask.long(), position_ids, mask


@pytest.mark.parametrize("kind", tiny_agents.DEFAULT_KINDS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_log_probs_and_gradients_match_verls_default(tiny_agent_paths, kind, temperature):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.utils import torch_functional as verl_F

    path = tiny_agent_paths[kind]
    tokenizer = AutoTokenizer.from_pretrained(path)
    load = dict(torch_dtype=torch.float32, attn_implementation="sdpa")
    plain = AutoModelForCausalLM.from_pretrained(path, **load)
    fused = _fused(AutoModelForCausalLM.from_pretrained(path, **load))
    input_ids, attention_mask, position_ids, valid = _inputs(tokenizer)
    labels = torch.roll(input_ids, shifts=-1, dims=-1)
    weights = torch.randn(input_ids.shape, generator=torch.Generator().manual_seed(1))

    # verl's default: logits / T, then logprobs_from_logits over the valid tokens
    assert not verl_F.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE  # the CPU path: the per-token loop
    logits = plain(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    expected = verl_F.logprobs_from_logits((logits / temperature)[valid], labels[valid])
    (expected * weights[valid]).sum().backward()

    out = fused(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        temperature=temperature, return_dict=True,
    )
    got = out.log_probs[valid]
    (got * weights[valid]).sum().backward()

    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    fused_grads = {n: p.grad for n, p in fused.named_parameters() if p.grad is not None}
    assert grads.keys() == fused_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_cpu_preset_selects_the_fused_torch_path(tiny_agent_paths):
    from hydra import compose, initialize_config_module

    from recipe_hacpo.config import agent_verl_config, validate

    with initialize_config_module("recipe_hacpo.configs", version_base=None):
        cfg = compose("hacpo_cpu_demo", overrides=[
            f"agents.0.model_path={tiny_agent_paths['qwen2-char-small']}",
            f"agents.1.model_path={tiny_agent_paths['llama-pair-medium']}",
        ])
    specs, _ = validate(cfg)
    for spec in specs:
        model = agent_verl_config(cfg, spec).actor_rollout_ref.model
        assert model.use_fused_kernels is True, spec.name
        assert model.fused_kernel_options.impl_backend == "torch", spec.name
