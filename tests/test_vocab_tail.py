"""The output rows beyond the tokenizer's ids (workers/vocab_tail.py): banned on the actor's,
the reference's and the hf backend's output layer as verl's vLLM engine bans them, so every
side scores one distribution; left alone where the output layer has no such rows."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from recipe_hacpo.workers.vocab_tail import ban_vocab_tail, tail_start


class _Tok:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def _model(vocab: int, tie: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg).eval()


def test_tail_log_probs_equal_the_engines_renormalised_ones_by_hand():
    for tie in (True, False):
        model = _model(80, tie)
        ids = torch.tensor([[1, 5, 9, 60, 3]])
        with torch.no_grad():
            full = model(ids).logits
        assert ban_vocab_tail(model, _Tok(70)) == 70
        with torch.no_grad():
            banned = model(ids).logits
        # the engine's distribution: log_softmax over the tokenizer's 70 ids only
        expected = torch.log_softmax(full[..., :70], -1)
        got = torch.log_softmax(banned, -1)
        assert torch.allclose(got[..., :70], expected, atol=1e-6)
        assert torch.exp(got[..., 70:]).max() == 0
        # before the ban the two differ by log(1 - tail mass): what the check would have seen
        assert (torch.log_softmax(full, -1)[..., :70] - expected).abs().min() > 1e-3
        # entropy stays finite (no 0 · -inf), in bf16 and under a temperature too
        for dtype in (torch.float32, torch.bfloat16):
            z = banned.to(dtype) / 0.6
            p = torch.softmax(z.float(), -1)
            assert torch.isfinite(-(p * torch.log_softmax(z.float(), -1)).sum(-1)).all()


def test_gradient_never_reaches_the_banned_rows_through_the_logits():
    model = _model(80, tie=False)
    ban_vocab_tail(model, _Tok(70))
    loss = torch.log_softmax(model(torch.tensor([[1, 2, 3]])).logits, -1)[0, -1, 7]
    loss.backward()
    grad = model.get_output_embeddings().weight.grad
    assert grad[70:].abs().max() == 0 and grad[:70].abs().max() > 0


def test_no_tail_no_hook_and_the_ban_is_registered_once():
    model = _model(64, tie=True)
    assert tail_start(model, _Tok(64)) is None and ban_vocab_tail(model, _Tok(64)) is None
    assert not model.get_output_embeddings()._forward_hooks
    model = _model(80, tie=True)
    ban_vocab_tail(model, _Tok(70))
    ban_vocab_tail(model, _Tok(70))
    assert len(model.get_output_embeddings()._forward_hooks) == 1
