"""Tiny agents of the presets' architectures (Qwen3 tied / untied, Llama-3.2 tied) with the real
tokenizers: what their configs keep of the public ones, and that transformers' Auto* classes
load them back as built (the tokenizer AutoTokenizer picks gives the ids of the one built)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from recipe_hacpo import real_tokenizers, tiny_agents
from recipe_hacpo.real_tokenizers import TokenizerFetchError, load_tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 5+3?"}]
TEXTS = [
    "5+3=8",
    r"\frac{1}{2} + \sqrt{x} = \boxed{8}",
    "<think>\nadd\n</think>\n\n8",
    "  runs   of spaces . and , punctuation 's",
    "中文 🙂 naïve",
    "<|im_end|> <|eot_id|> typed as text",
]

# (model_type, architecture, tied, tokenizer, vocab_size, rope_theta, rms_norm_eps) of the public configs
PUBLIC = {
    "qwen3-tied": ("qwen3", "Qwen3ForCausalLM", True, "qwen3", 151_936, 1_000_000.0, 1e-6),
    "qwen3-untied": ("qwen3", "Qwen3ForCausalLM", False, "qwen3", 151_936, 1_000_000.0, 1e-6),
    "llama3p2-tied": ("llama", "LlamaForCausalLM", True, "llama3", 128_256, 500_000.0, 1e-5),
}


@pytest.fixture(scope="module")
def real_agent_paths(tmp_path_factory):
    return tiny_agents.build_default_agents(str(tmp_path_factory.mktemp("real_arch")), tiny_agents.REAL_ARCH_KINDS)


def test_kinds_are_the_presets_architectures():
    assert tiny_agents.REAL_ARCH_KINDS == ("qwen3-tied", "qwen3-untied", "llama3p2-tied")
    from recipe_hacpo.cluster.planner import SHIPPED_SPECS

    with open(SHIPPED_SPECS) as f:
        presets = json.load(f)["models"]
    for kind, spec in tiny_agents.REAL_ARCH_KIND_SPECS.items():
        model_type, _, tied, _, vocab, _, _ = PUBLIC[kind]
        same_family = [m for m in presets.values() if m["model_type"] == model_type]
        assert same_family and all(m["vocab_size"] == vocab == spec.vocab_size for m in same_family)
        assert any(m["tie_word_embeddings"] is tied for m in same_family)
        assert spec.num_kv_heads < spec.num_heads  # GQA, as every preset
        assert spec.head_dim == 32  # a head size vLLM's CPU attention takes
    # Qwen3's head_dim is its own field, not hidden / heads (Qwen3-0.6B: 1024 / 16 = 64, head_dim 128)
    assert any(m["head_dim"] != m["hidden_size"] // m["num_attention_heads"] for m in presets.values()
               if m["model_type"] == "qwen3")
    qwen3 = tiny_agents.REAL_ARCH_KIND_SPECS["qwen3-tied"]
    assert qwen3.head_dim != qwen3.hidden_size // qwen3.num_heads


@pytest.mark.parametrize("kind", tiny_agents.REAL_ARCH_KINDS)
def test_round_trip_through_auto_classes(real_agent_paths, kind):
    path = real_agent_paths[kind]
    model_type, arch, tied, tok_name, vocab, theta, eps = PUBLIC[kind]
    spec = tiny_agents.REAL_ARCH_KIND_SPECS[kind]
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == model_type and config.architectures == [arch]
    assert config.vocab_size == vocab and config.tie_word_embeddings is tied
    assert config.head_dim == 32 and config.num_key_value_heads < config.num_attention_heads
    assert config.rms_norm_eps == eps and config.rope_parameters["rope_theta"] == theta
    if model_type == "llama":
        rope = config.rope_parameters
        assert (rope["rope_type"], rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]) == ("llama3", 32.0, 1.0, 4.0)
        assert rope["original_max_position_embeddings"] == 8192 < config.max_position_embeddings
        assert config.mlp_bias is False and config.attention_bias is False

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    assert type(model).__name__ == arch and model.dtype == torch.float32
    shared = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert shared is tied
    if model_type == "qwen3":  # q/k norm is part of Qwen3's attention
        assert model.model.layers[0].self_attn.q_norm.weight.shape == (32,)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (spec.num_heads * 32, spec.hidden_size)

    tok = AutoTokenizer.from_pretrained(path)
    built = load_tokenizer(tok_name)
    assert len(tok) == len(built) <= config.vocab_size
    assert tok.chat_template == built.chat_template
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (built.pad_token_id, built.eos_token_id, built.bos_token_id)
    for text in TEXTS:
        assert tok.encode(text) == built.encode(text), text
        assert tok(text, split_special_tokens=True)["input_ids"] == built(text, split_special_tokens=True)["input_ids"]
    gen = GenerationConfig.from_pretrained(path)
    assert tok.eos_token_id in gen.eos_token_id and len(gen.eos_token_id) == (2 if model_type == "qwen3" else 3)
    assert config.pad_token_id == tok.pad_token_id is not None

    ids = torch.tensor([tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], vocab) and torch.isfinite(logits).all()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert ids.shape[1] < out.shape[1] <= ids.shape[1] + 3

    # verl's agent loop renders the prompt with a builder chosen by model_type: same ids
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    builder = create_continuous_token_builder(tok, hf_model_type=model_type)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert builder.build_initial_tokens(MESSAGES) == tok.encode(text, add_special_tokens=False)


def test_spec_record_carries_the_tokenizer_identity(tmp_path, monkeypatch):
    path = tiny_agents.build_agent(str(tmp_path), "llama3p2-tied")
    with open(os.path.join(path, tiny_agents.SPEC_FILE)) as f:
        record = json.load(f)
    assert record["tokenizer_fingerprint"] == real_tokenizers.fingerprint("llama3")
    stamp = os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns
    assert tiny_agents.build_agent(str(tmp_path), "llama3p2-tied") == path
    assert os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns == stamp  # reused
    monkeypatch.setattr(real_tokenizers, "fingerprint", lambda name: "another-tokenizer")
    tiny_agents.build_agent(str(tmp_path), "llama3p2-tied")  # a changed tokenizer rebuilds
    with open(os.path.join(path, tiny_agents.SPEC_FILE)) as f:
        assert json.load(f)["tokenizer_fingerprint"] == "another-tokenizer"


def test_missing_tokenizer_fails_before_any_model(tmp_path, monkeypatch):
    monkeypatch.setenv(real_tokenizers.CACHE_ENV, str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "no-npm"))
    built = []
    monkeypatch.setattr(tiny_agents, "build_real_arch_model", lambda *a: built.append(a))
    with pytest.raises(TokenizerFetchError, match="`npm` is not on PATH") as err:
        tiny_agents.build_agent(str(tmp_path / "agents"), "qwen3-tied")
    assert "\n" not in str(err.value) and built == []
    assert not os.path.exists(tmp_path / "agents" / "qwen3-tied")


def test_existing_kinds_unchanged():
    """The records of the shipped kinds (and so their directories and warm starts) stay as they were."""
    assert tiny_agents._spec_record("llama-pair-medium", 2) == {
        "kind": "llama-pair-medium", "seed": 2, "version": 2, "arch": "llama", "tokenizer": "pair",
        "hidden_size": 96, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 192,
        "tie_word_embeddings": False,
    }
    assert set(tiny_agents.AGENT_KINDS) | set(tiny_agents.REAL_ARCH_KINDS) == set(tiny_agents.ALL_KINDS)
    assert not set(tiny_agents.AGENT_KINDS) & set(tiny_agents.REAL_ARCH_KINDS)


def test_warm_start_loss_on_labelled_positions_equals_the_full_logits_loss(monkeypatch):
    """For the real vocabularies warm_start applies the output layer to the labelled positions
    only; the loss (and its gradient) must be the full-logits one."""
    from recipe_hacpo import warm_start as ws
    from recipe_hacpo.data import synthetic

    tok = load_tokenizer("llama3")
    model = tiny_agents.build_real_arch_model(tiny_agents.REAL_ARCH_KIND_SPECS["llama3p2-tied"], tok, 0)
    prompts, answers = ws.encode_rows(tok, synthetic.generate("add1", "train", 8, 0))
    batch = ws.make_batch(prompts, answers, tok.pad_token_id)
    assert model.config.vocab_size >= ws.SPARSE_LOGITS_MIN_VOCAB
    sparse = ws.sft_loss(model, batch)
    (grad_sparse,) = torch.autograd.grad(sparse, model.model.embed_tokens.weight)
    monkeypatch.setattr(ws, "SPARSE_LOGITS_MIN_VOCAB", 10**9)
    full = ws.sft_loss(model, batch)
    (grad_full,) = torch.autograd.grad(full, model.model.embed_tokens.weight)
    torch.testing.assert_close(sparse, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_sparse, grad_full, rtol=1e-4, atol=1e-7)
    assert float(full) > 1.0  # an untrained model: not a trivially zero loss
