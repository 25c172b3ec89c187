"""Supervised warm start: the trained sequence is the rollout's, the run is deterministic, and the
saved directory is a complete Hugging Face agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from recipe_hacpo import warm_start as ws
from recipe_hacpo.data import synthetic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("tok_fixture", ["char_tokenizer", "pair_tokenizer"])
def test_labels_are_answer_and_eos_after_the_chat_template(request, tok_fixture):
    tok = request.getfixturevalue(tok_fixture)
    rows = synthetic.generate("add3", "train", 3, 0)
    prompts, answers = ws.encode_rows(tok, rows)
    batch = ws.make_batch(prompts, answers, tok.pad_token_id)
    for i, row in enumerate(rows):
        rendered = tok.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=False)
        assert tok.decode(prompts[i]) == rendered
        assert rendered.endswith("assistant\n") or rendered.endswith("<|end_header_id|>\n\n")
        truth = row["reward_model"]["ground_truth"]
        assert answers[i][-1] == tok.eos_token_id
        assert tok.decode(answers[i][:-1]) == truth
        labels = batch["labels"][i]
        supervised = labels[labels != -100].tolist()
        assert supervised == answers[i]
        # the labels sit exactly after the prompt
        start = len(prompts[i])
        assert batch["input_ids"][i, start:start + len(answers[i])].tolist() == answers[i]
        assert (labels[:start] == -100).all()


def test_pair_tokenizer_answer_is_digit_pairs(pair_tokenizer):
    rows = synthetic.generate("add3", "train", 1, 0)
    _, answers = ws.encode_rows(pair_tokenizer, rows)
    assert len(answers[0]) == 3  # two digit pairs + EOS


def test_answer_matches_is_exact_on_the_last_integer():
    assert ws.answer_matches("0579", "0579")
    assert ws.answer_matches("x 12 0579", "0579")
    assert not ws.answer_matches("579", "0579")
    assert not ws.answer_matches("", "0579")


def _tiny(kind: str, seed: int = 0) -> ws.WarmStartArgs:
    return ws.WarmStartArgs(kind=kind, task="add3", steps=6, seed=seed, batch_size=16, n_train=200, n_eval=32)


@pytest.mark.parametrize("kind", ["qwen2-char-small", "llama-pair-medium"])
def test_deterministic_and_loadable(tmp_path, kind):
    a = ws.warm_start(_tiny(kind), str(tmp_path / "a"), verbose=False)
    b = ws.warm_start(_tiny(kind), str(tmp_path / "b"), verbose=False)
    wa = load_file(str(tmp_path / "a" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a["held_out_accuracy"] == b["held_out_accuracy"]
    # another seed gives other weights (state heterogeneity)
    ws.warm_start(_tiny(kind, seed=1), str(tmp_path / "c"), verbose=False)
    wc = load_file(str(tmp_path / "c" / "model.safetensors"))
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)
    # a complete HF agent directory
    path = str(tmp_path / "a")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    gen = GenerationConfig.from_pretrained(path)
    assert gen.eos_token_id == tok.eos_token_id
    assert tok.chat_template
    assert model.config.vocab_size >= len(tok)
    with open(os.path.join(path, ws.RECORD_FILE)) as f:
        rec = json.load(f)
    assert rec["kind"] == kind and 0.0 <= rec["held_out_accuracy"] <= 1.0


def test_training_lowers_the_loss(tmp_path):
    rec = ws.warm_start(
        ws.WarmStartArgs(kind="qwen2-char-small", steps=60, seed=0, batch_size=32, n_train=500, n_eval=16),
        str(tmp_path / "agent"), log_every=10, verbose=False,
    )
    losses = [h["loss"] for h in rec["loss_history"]]
    assert losses[-1] < losses[0] * 0.7


def test_cached_directory_is_reused(tmp_path):
    out = str(tmp_path / "agent")
    ws.warm_start(_tiny("qwen2-char-small"), out, verbose=False)
    stamp = os.path.getmtime(os.path.join(out, "model.safetensors"))
    ws.warm_start(_tiny("qwen2-char-small"), out, verbose=False)
    assert os.path.getmtime(os.path.join(out, "model.safetensors")) == stamp


def test_a_chain_copied_elsewhere_is_reused_and_its_parent_identifies_it(tmp_path):
    import dataclasses
    import shutil

    first = str(tmp_path / "here" / "parent")
    ws.warm_start(_tiny("qwen2-char-small"), first, verbose=False)
    ws.warm_start(dataclasses.replace(_tiny("qwen2-char-small"), init=first), str(tmp_path / "here" / "child"), verbose=False)
    shutil.copytree(tmp_path / "here", tmp_path / "there")  # e.g. agents shipped with the repository
    parent, child = str(tmp_path / "there" / "parent"), str(tmp_path / "there" / "child")
    stamp = os.path.getmtime(os.path.join(child, "model.safetensors"))
    ws.warm_start(dataclasses.replace(_tiny("qwen2-char-small"), init=parent), child, verbose=False)
    assert os.path.getmtime(os.path.join(child, "model.safetensors")) == stamp  # same chain, other folder
    # a child of another parent is another agent: trained again
    other = str(tmp_path / "there" / "other_parent")
    ws.warm_start(_tiny("qwen2-char-small", seed=1), other, verbose=False)
    ws.warm_start(dataclasses.replace(_tiny("qwen2-char-small"), init=other), child, verbose=False)
    assert os.path.getmtime(os.path.join(child, "model.safetensors")) != stamp


def test_cli_prints_held_out_accuracy(tmp_path):
    out = str(tmp_path / "cli")
    proc = subprocess.run(
        [sys.executable, "-m", "recipe_hacpo.warm_start", "--kind", "qwen2-char-small", "--task", "add3",
         "--steps", "3", "--out", out, "--seed", "0", "--batch-size", "8", "--n-train", "100", "--n-eval", "16"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out accuracy" in proc.stdout and "3 steps in " in proc.stdout and "reused" not in proc.stdout
    assert os.path.isfile(os.path.join(out, "config.json"))
    # the same command again keeps the agent, and says so (its seconds are those of when it was made)
    again = subprocess.run(proc.args, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "reused as is (its 3 steps took " in again.stdout and "held-out accuracy" in again.stdout, again.stdout


def test_a_task_rows_only_warm_start_is_kept_as_a_small_state_and_restored_bit_for_bit(tmp_path):
    """The real-tokenizer agents the golden runs train: only the task's embedding rows move, and
    the state over the seeded init rebuilds the same bits; a state over another init is refused."""
    from safetensors import safe_open

    from recipe_hacpo import tiny_agents

    args = ws.WarmStartArgs(kind="qwen3-tied", task="add1", steps=3, lr=1e-2, batch_size=8, n_train=64, n_eval=8,
                            task_rows_only=True)
    trained = str(tmp_path / "trained")
    record = ws.warm_start(args, trained, verbose=False)
    init = load_file(os.path.join(tiny_agents.build_agent(str(tmp_path / "init"), "qwen3-tied", 0), "model.safetensors"))
    weights = load_file(os.path.join(trained, "model.safetensors"))
    embedding = "model.embed_tokens.weight"
    moved = (weights[embedding] != init[embedding]).any(1)
    assert 0 < int(moved.sum()) < 64  # the task's few rows of 151k
    assert all(not torch.equal(weights[k], init[k]) for k in weights if k.endswith("q_proj.weight"))

    state = str(tmp_path / "state.safetensors")
    ws.save_trained_state(trained, state)
    assert os.path.getsize(state) < os.path.getsize(os.path.join(trained, "model.safetensors")) / 50
    with safe_open(state, "pt") as f:
        assert f.get_tensor(embedding + ".rows").tolist() == moved.nonzero().flatten().tolist()
    restored = str(tmp_path / "restored")
    assert ws.restore_trained_state(state, restored) == record
    assert ws.reusable(args, restored) == record
    again = load_file(os.path.join(restored, "model.safetensors"))
    assert sorted(again) == sorted(weights) and all(torch.equal(again[k], weights[k]) for k in weights)
    model = AutoModelForCausalLM.from_pretrained(restored)
    assert model.config.tie_word_embeddings and AutoTokenizer.from_pretrained(restored).eos_token_id is not None

    from safetensors.torch import save_file

    with safe_open(state, "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())
    save_file(tensors, state, metadata={**meta, "init": "0" * 32})
    with pytest.raises(ValueError, match="the seeded init of qwen3-tied built here differs"):
        ws.restore_trained_state(state, str(tmp_path / "other"))
