"""benchmarks/preset_shapes_step.py's agents (quick tier): the presets' public configs give the
shapes, the family gives vocabulary, tying and tokenizer; a config of another family is refused
in one line. The GPU run itself is the preflight's train run (tests/test_preflight.py)."""

from __future__ import annotations

import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
try:
    import preset_shapes_step as bench
finally:
    sys.path.pop(0)


@pytest.mark.parametrize("name, kind", [("Qwen3-0.6B-Base", "qwen3-tied"), ("Qwen3-8B-Base", "qwen3-untied"),
                                        ("Llama-3.2-1B-Instruct", "llama3p2-tied"),
                                        ("Llama-3.2-3B-Instruct", "llama3p2-tied")])
def test_spec_has_the_public_configs_shapes_and_the_familys_rest(name, kind):
    from recipe_hacpo.tiny_agents import REAL_ARCH_KIND_SPECS

    with open(os.path.join(bench.SHAPES_DIR, name, "config.json")) as f:
        shape = json.load(f)
    spec = bench.spec_for(name)
    family = REAL_ARCH_KIND_SPECS[kind]
    for field, key in bench.SHAPE_FIELDS.items():
        assert getattr(spec, field) == shape[key], field
    assert (spec.vocab_size, spec.tie_word_embeddings) == (shape["vocab_size"], shape["tie_word_embeddings"])
    assert (spec.tokenizer, spec.rope_theta, spec.rope_scaling) == (family.tokenizer, family.rope_theta,
                                                                   family.rope_scaling)
    assert bench.spec_for(name, tiny=True) == family


def test_a_config_of_another_family_is_one_line_naming_it(tmp_path, monkeypatch):
    (tmp_path / "Mistral-7B").mkdir()
    (tmp_path / "Mistral-7B" / "config.json").write_text(json.dumps({"model_type": "mistral", "vocab_size": 32768}))
    monkeypatch.setattr(bench, "SHAPES_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=r"Mistral-7B/config.json: model_type 'mistral'") as err:
        bench.spec_for("Mistral-7B")
    assert "\n" not in str(err.value)


def test_an_agent_built_at_tiny_width_loads_with_its_vocabulary_and_tokenizer(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = bench.spec_for("Llama-3.2-1B-Instruct", tiny=True)
    n = bench.build_agent_at(spec, str(tmp_path / "a"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a"))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert n == sum(p.numel() for p in model.parameters())
    assert model.config.vocab_size == 128_256 and model.config.tie_word_embeddings
    assert model.config.dtype == torch.bfloat16 and len(tok) == 128_256
    assert bench.agent_name("Llama-3.2-1B-Instruct") == "llama_3_2_1b_instruct"
