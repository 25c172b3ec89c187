"""LoRA agents: an adapter folded into its base weights for evaluation (by hand against peft's own
model), and end to end a LoRA agent beside a full agent through Ray on CPU with the `hf` rollout:
only the adapter trains, its reference policy is its actor with the adapter off, resume from a
checkpoint reproduces the uninterrupted step, and `evaluate` loads the checkpoint."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from helpers.golden import training_metrics
from helpers.e2e import assert_finite_losses, assert_weights_changed, checkpoint_weights, run_main, train_steps

from recipe_hacpo import batch_keys as K
from recipe_hacpo.evaluation import EvalError
from recipe_hacpo.evaluation.checkpoints import fold_lora, resolve_checkpoint

RANK, ALPHA = 8, 16
NAMES = ("qwen_lora", "llama_full")


def _peft_model(model_dir: str, rank: int = 4, alpha: int = 8, seed: int = 0):
    """The tiny model under a peft LoRA adapter with non-zero B (peft starts B at zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules="all-linear", bias="none"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    return model.eval()


def test_folded_adapter_gives_the_adapted_models_logits(tiny_agent_paths):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = tiny_agent_paths["qwen2-char-small"]
    adapted = _peft_model(model_dir)
    state = adapted.state_dict()
    assert any(".lora_A.default.weight" in k for k in state) and any(".base_layer." in k for k in state)
    plain = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).eval()
    missing, unexpected = plain.load_state_dict(fold_lora(state, 4, 8), strict=True)
    assert not missing and not unexpected
    ids = torch.randint(0, plain.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = adapted(input_ids=ids).logits, plain(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # the comparison has teeth: the adapter moves the logits away from the base model's
    assert (want - base).abs().max() > 1e-3


def test_fold_refuses_an_incomplete_adapter(tiny_agent_paths):
    state = _peft_model(tiny_agent_paths["qwen2-char-small"]).state_dict()
    key = next(k for k in state if k.endswith("q_proj.lora_B.default.weight"))
    del state[key]
    with pytest.raises(EvalError, match=r"LoRA adapter of model\.layers\.0\.self_attn\.q_proj is incomplete"):
        fold_lora(state, 4, 8, "ckpt/actor")


@pytest.mark.parametrize(
    "model, message",
    [
        ("lora_rank:8,lora_alpha:16,target_modules:all-linear",
         r"agents\.qwen_lora\.actor_rollout_ref\.model\.lora\.merge=false with rollout\.name=hf"),
        ("lora_rank:8,lora_alpha:16,target_modules:null,lora:{merge:true}",
         r"agents\.qwen_lora\.actor_rollout_ref\.model\.target_modules: empty"),
        ("lora_rank:8,lora_alpha:0,lora:{merge:true}", r"agents\.qwen_lora\.actor_rollout_ref\.model: lora_rank=8, lora_alpha=0: need"),
    ],
)
def test_a_lora_agent_the_run_cannot_serve_is_refused_before_ray(model, message):
    from hydra import compose, initialize_config_module

    from recipe_hacpo.config import ConfigError, validate

    agents = ["~agents", f"+agents={{qwen_lora:{{model_path:/m/a,rollout_n:4,n_gpus_per_node:1,nnodes:1,"
              f"actor_rollout_ref:{{model:{{{model}}}}}}},llama_full:{{model_path:/m/b,rollout_n:4,"
              "n_gpus_per_node:1,nnodes:1,actor_rollout_ref:{}}}"]
    with initialize_config_module("recipe_hacpo.configs", version_base=None):
        cfg = compose("hacpo_cpu_demo", overrides=agents)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, check_paths=False)


def _agents(paths: dict[str, str]) -> list[str]:
    from recipe_hacpo.config import agents_overrides

    model = dict(lora_rank=RANK, lora_alpha=ALPHA, target_modules="all-linear", lora=dict(merge=True))
    lora = dict(name=NAMES[0], model_path=paths["qwen2-char-small"], rollout_n=4, n_gpus_per_node=1, nnodes=1,
                actor_rollout_ref=dict(model=model, actor=dict(use_kl_loss=True, kl_loss_coef=0.1)))
    full = dict(name=NAMES[1], model_path=paths["llama-pair-medium"], rollout_n=4, n_gpus_per_node=1, nnodes=1)
    return [*agents_overrides([lora, full]), "ray_kwargs.ray_init.num_gpus=2"]


COMMON = ["trainer.total_training_steps=3", "trainer.save_freq=1", "trainer.test_freq=-1",
          "trainer.val_before_train=false"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, warm_agent_paths):
    out = str(tmp_path_factory.mktemp("lora"))
    records = run_main(out, _agents(warm_agent_paths) + COMMON + [f"trainer.learner_batch_dir={out}/batches"])
    return out, train_steps(records)


def _log_probs(model_dir: str, batch) -> torch.Tensor:
    """log π of every response token of a learner batch, [B, T], under the model saved in `model_dir`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    resp_len = batch.batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=batch.batch["position_ids"]).logits
    logp = torch.log_softmax(logits[:, -resp_len - 1 : -1].float(), dim=-1)
    return logp.gather(-1, ids[:, -resp_len:].unsqueeze(-1)).squeeze(-1)


@pytest.mark.e2e
@pytest.mark.ray
def test_lora_agent_trains_only_its_adapter_beside_a_full_agent(lora_run, warm_agent_paths):
    from verl import DataProto

    out, steps = lora_run
    assert sorted(steps) == [1, 2, 3]
    assert_finite_losses(steps, list(NAMES))
    # the full agent's weights moved; the LoRA agent's base weights are the warm start's, bit for bit,
    # and its adapter (B starts at zero) is what moved
    assert_weights_changed(warm_agent_paths["llama-pair-medium"], os.path.join(out, "ckpt", "global_step_3", NAMES[1]))
    lora_dir = os.path.join(out, "ckpt", "global_step_3", NAMES[0])
    trained = checkpoint_weights(lora_dir)
    initial = load_file(os.path.join(warm_agent_paths["qwen2-char-small"], "model.safetensors"))
    base = {k[len("base_model.model."):].replace(".base_layer.", "."): v for k, v in trained.items() if "lora_" not in k}
    assert set(initial) <= set(base)  # (and the tied LM head, which the warm start does not store)
    assert all(torch.equal(base[k], initial[k].float()) for k in initial)
    adapter_b = [v for k, v in trained.items() if ".lora_B." in k]
    assert len(adapter_b) == 2 * 7 and all(v.abs().max() > 0 for v in adapter_b)  # 2 layers × 7 projections
    assert json.loads(open(os.path.join(lora_dir, "actor", "lora_train_meta.json")).read())["r"] == RANK
    # its reference policy is the actor with the adapter off: the warm start's own log-probs
    batch = DataProto.load_from_disk(os.path.join(out, "batches", "step_3", f"{NAMES[0]}.pkl"))
    mask = batch.batch["response_mask"].bool()
    expected = _log_probs(warm_agent_paths["qwen2-char-small"], batch)
    assert torch.allclose(batch.batch["ref_log_prob"][mask], expected[mask], atol=1e-4)
    # ... not the adapted actor's (by step 3 the adapter has moved it; a peer row's old_log_probs
    # are its source's, so own rows only)
    own = mask & ~batch.batch[K.IS_CROSS].bool().unsqueeze(-1)
    assert (batch.batch["old_log_probs"][own] - expected[own]).abs().max() > 1e-4
    assert steps[3][f"agent/{NAMES[0]}/actor/kl_loss"] > 0


@pytest.mark.e2e
@pytest.mark.ray
def test_lora_resume_from_a_checkpoint_reproduces_the_uninterrupted_step(lora_run, warm_agent_paths, tmp_path):
    out, steps = lora_run
    resumed = run_main(
        str(tmp_path),
        _agents(warm_agent_paths) + COMMON
        + ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={out}/ckpt/global_step_2"],
    )
    again = train_steps(resumed)
    assert sorted(again) == [3]
    expected, got = training_metrics(steps[3]), training_metrics(again[3])
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert expected[f"agent/{NAMES[0]}/actor/pg_loss"] != steps[2][f"agent/{NAMES[0]}/actor/pg_loss"]


@pytest.mark.e2e
@pytest.mark.ray
def test_evaluate_loads_a_lora_checkpoint(lora_run, tmp_path):
    from helpers.evaluation import write_bench as _bench
    from verl import DataProto

    from recipe_hacpo import evaluate as ev

    out, _ = lora_run
    # step 2's checkpoint, adapter folded in, is the policy that computed step 3's old log-probs
    merged = resolve_checkpoint(os.path.join(out, "ckpt", "global_step_2", NAMES[0]), str(tmp_path / "merged"))
    assert not any("lora_" in k or k.startswith("base_model.") for k in load_file(os.path.join(merged, "model.safetensors")))
    batch = DataProto.load_from_disk(os.path.join(out, "batches", "step_3", f"{NAMES[0]}.pkl"))
    # own rows: a peer row's old_log_probs are its source's
    own = batch.batch["response_mask"].bool() & ~batch.batch[K.IS_CROSS].bool().unsqueeze(-1)
    got, want = _log_probs(merged, batch)[own], batch.batch["old_log_probs"][own]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    # and the evaluation CLI takes the checkpoint as it is
    lora_dir = os.path.join(out, "ckpt", "global_step_3", NAMES[0])
    rc = ev.main(["--checkpoint", f"lora={lora_dir}", "--bench", f"gsm8k={_bench(tmp_path, 'gsm8k')}", "--backend", "hf",
                  "--device", "cpu", "--max-new-tokens", "4", "--out", str(tmp_path / "eval")])
    assert rc == 0
    assert "gsm8k" in json.loads((tmp_path / "eval" / "metrics.json").read_text())["lora"]
    assert (tmp_path / "eval" / "table.md").read_text().splitlines()[2].startswith("| lora |")
