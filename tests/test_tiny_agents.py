"""The tiny offline agents load back through the Auto* classes and behave like real checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from recipe_hacpo import tiny_agents

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 0123+0456?"}]

MATH_TEXTS = [
    "0123+0456=579",
    "Compute (12-3)*4 = 36, so x^2_1 = \\frac{1}{2}.",
    "  leading and trailing spaces \n\n\ttab ",
    "\\boxed{\\sqrt{2}} \\cdot \\pi \\le 3.15, {a_n}_{n=1}^{100}",
    "π ≈ 3.14159; ∑_{k=0}^{∞} 1/k! = e; 中文 🙂",
    "",
]


@pytest.mark.parametrize("kind", tiny_agents.DEFAULT_KINDS)
def test_agent_loads_with_auto_classes(tiny_agent_paths, kind):
    path = tiny_agent_paths[kind]
    spec = tiny_agents.AGENT_KINDS[kind]
    config = AutoConfig.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    gen = GenerationConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")

    assert config.model_type == spec.arch
    assert config.hidden_size == spec.hidden_size and config.num_hidden_layers == spec.num_layers
    assert config.vocab_size == len(tok)
    assert config.max_position_embeddings >= 512
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    assert None not in (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id)
    assert gen.eos_token_id == tok.eos_token_id and gen.pad_token_id == tok.pad_token_id

    # The reloaded tokenizer must be the one that was built, id for id.
    built = tiny_agents.TOKENIZER_BUILDERS[spec.tokenizer]()
    for text in MATH_TEXTS:
        assert tok.encode(text) == built.encode(text)

    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert "What is 0123+0456?" in prompt
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()

    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert out.shape[0] == 1 and ids.shape[1] < out.shape[1] <= ids.shape[1] + 4


def test_chat_templates_differ(tiny_agent_paths):
    rendered = {
        kind: AutoTokenizer.from_pretrained(path).apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=False
        )
        for kind, path in tiny_agent_paths.items()
    }
    assert rendered["qwen2-char-small"] == rendered["qwen2-char-medium"]
    assert rendered["qwen2-char-small"] != rendered["llama-pair-medium"]
    assert rendered["qwen2-char-small"].endswith("<|im_start|>assistant\n")
    assert rendered["llama-pair-medium"].endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_tokenizers_segment_digits_differently(char_tokenizer, pair_tokenizer):
    text = "0123+0456="
    char_pieces = char_tokenizer.convert_ids_to_tokens(char_tokenizer.encode(text))
    pair_pieces = pair_tokenizer.convert_ids_to_tokens(pair_tokenizer.encode(text))
    assert char_pieces == list(text)
    assert pair_pieces == ["01", "23", "+", "04", "56", "="]
    assert pair_tokenizer.convert_ids_to_tokens(pair_tokenizer.encode("012")) == ["01", "2"]
    assert char_tokenizer.eos_token != pair_tokenizer.eos_token


@pytest.mark.parametrize("text", MATH_TEXTS)
def test_round_trip_is_exact(char_tokenizer, pair_tokenizer, text):
    for tok in (char_tokenizer, pair_tokenizer):
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


def test_build_agent_is_idempotent(tmp_path):
    path = tiny_agents.build_agent(str(tmp_path), "qwen2-char-small", seed=3)
    marker = os.path.join(path, tiny_agents.SPEC_FILE)
    weights = os.path.join(path, "model.safetensors")
    stamp = os.stat(weights).st_mtime_ns
    assert tiny_agents.build_agent(str(tmp_path), "qwen2-char-small", seed=3) == path
    assert os.stat(weights).st_mtime_ns == stamp
    with open(marker) as f:
        assert json.load(f)["seed"] == 3

    first = AutoModelForCausalLM.from_pretrained(path).model.embed_tokens.weight.clone()
    tiny_agents.build_agent(str(tmp_path), "qwen2-char-small", seed=4)  # different spec: rebuilt
    second = AutoModelForCausalLM.from_pretrained(path).model.embed_tokens.weight
    assert not torch.equal(first, second)


def test_cli_builds_requested_kinds(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "recipe_hacpo.tiny_agents", "--out", str(tmp_path), "--kinds", "qwen2-char-small"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == [str(tmp_path / "qwen2-char-small")]
    assert (tmp_path / "qwen2-char-small" / tiny_agents.SPEC_FILE).exists()


@pytest.mark.parametrize("kind", tiny_agents.DEFAULT_KINDS)
def test_verl_renders_the_same_prompt(tiny_agent_paths, kind):
    """verl's agent loop renders prompts with a continuous-token builder chosen by model_type."""
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    path = tiny_agent_paths[kind]
    tok = AutoTokenizer.from_pretrained(path)
    builder = create_continuous_token_builder(tok, hf_model_type=AutoConfig.from_pretrained(path).model_type)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert builder.build_initial_tokens(MESSAGES) == tok.encode(text, add_special_tokens=False)
