"""GPU memory plan (recipe_hacpo/cluster/planner.py) and the memory checks `config.validate` runs
before Ray, on the real shapes of the presets' models (tests/fixtures/model_shapes/*/config.json
and the figures shipped in recipe_hacpo/cluster/model_specs.json, both from the public config.json files)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from recipe_hacpo.cluster import planner
from recipe_hacpo.config import ConfigError, agent_specs, validate
from helpers.compose import compose_config as _compose

REPO = Path(__file__).resolve().parents[1]
SHAPES = REPO / "tests" / "fixtures" / "model_shapes"
PRESETS = sorted(p.stem for p in (REPO / "configs").glob("pair_*.yaml"))
GIB = 1024**3
SHIPPED = json.loads((REPO / "recipe_hacpo" / "cluster" / "model_specs.json").read_text())["models"]


def _shape(name: str) -> planner.ModelShape:
    return planner.ModelShape.from_config(planner.read_model_config(str(SHAPES / name)))




def _local_models(preset: str) -> list[str]:
    """Point both agents of a preset at the fixture config.json of its default hub model."""
    cfg = _compose(preset)
    return [f"agents.{name}.model_path={SHAPES / Path(a.model_path).name}" for name, a in cfg.agents.items()]


@pytest.fixture(autouse=True)
def _no_path_env(monkeypatch):
    for var in ("HACPO_MODEL_A", "HACPO_MODEL_B", "HACPO_DATA_DIR", "HACPO_OUTPUT_DIR"):
        monkeypatch.delenv(var, raising=False)


# parameter counts of the model cards (embeddings included)
@pytest.mark.parametrize(
    "name, billions",
    [
        ("Qwen3-0.6B-Base", 0.60), ("Qwen3-1.7B-Base", 1.72), ("Qwen3-4B", 4.02), ("Qwen3-4B-Base", 4.02),
        ("Qwen3-4B-Instruct-2507", 4.02), ("Qwen3-8B-Base", 8.19),
        ("Llama-3.2-1B-Instruct", 1.24), ("Llama-3.2-3B-Instruct", 3.21),
    ],
)
def test_parameter_count_matches_the_model_card(name, billions):
    assert _shape(name).num_params() / 1e9 == pytest.approx(billions, abs=0.01)


def test_kv_cache_of_qwen3_4b_instruct_at_its_full_context_is_36_gib():
    shape = _shape("Qwen3-4B-Instruct-2507")
    # 2 (K, V) · 36 layers · 8 KV heads · 128 · 2 bytes
    assert planner.kv_bytes_per_token(shape) == 2 * 36 * 8 * 128 * 2
    assert shape.max_position_embeddings == 262144
    assert planner.kv_bytes_per_token(shape) * 262144 / GIB == pytest.approx(36.0)
    # tensor parallel splits the KV heads, never below one per GPU
    assert planner.kv_bytes_per_token(shape, tp=2) * 2 == planner.kv_bytes_per_token(shape)
    assert planner.kv_bytes_per_token(shape, tp=16) == planner.kv_bytes_per_token(shape, tp=8)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_is_planned_and_fits_without_download(preset):
    """Hub ids that are not on disk are planned from the shipped figures, with the same numbers
    as from their config.json; every preset fits the GPU it names (trainer.gpu_memory_gib)."""
    cfg = _compose(preset)
    specs, _ = validate(cfg, check_paths=False)
    gib = float(cfg.trainer.gpu_memory_gib)
    plans = planner.plan(cfg, specs)
    assert [p.name for p in plans] == [s.name for s in specs]
    for p in plans:
        assert p.known and p.fits, (p.name, p.problems)
        assert "model_specs.json" in p.source
        assert p.max_model_len == cfg.data.max_prompt_length + cfg.data.max_response_length
        assert 0 < p.kv_needed < p.kv_budget
        assert max(p.rollout_need, p.update_need, p.sync_need, p.startup_need) <= gib * GIB
        assert 0 < p.activations < p.train_peak
        if preset.endswith(("_4gpu", "_1gpu")):
            assert (p.pool, p.gpus, p.resident) == ("shared", int(preset[-4]), 0)
        else:
            assert p.pool == "own" and p.resident == p.fsdp_weights + p.fsdp_adam
        if not p.offload_policy:
            assert p.train_peak == p.fsdp_weights + p.fsdp_grads + p.fsdp_adam + p.activations
            # Adam moments of what trains: every parameter, or a LoRA agent's adapter only
            assert p.fsdp_adam == 8 * (p.lora_params if p.lora_rank else p.params) // p.gpus
            assert bool(p.lora_rank) == ("_lora" in preset)
    text = planner.format_plan(plans, gib)
    assert text.count("    fits") == len(plans) and "DOES NOT FIT" not in text
    assert text.count("not on disk: figures shipped in recipe_hacpo/cluster/model_specs.json") == len(plans)
    # from the models' config.json on disk: the same figures
    on_disk = _compose(preset, _local_models(preset))
    disk_plans = planner.plan(on_disk, agent_specs(on_disk))
    assert [p.source for p in disk_plans] == ["config.json on disk"] * len(plans)
    assert [(p.params, p.train_peak, p.kv_needed, p.rollout_need) for p in disk_plans] == [
        (p.params, p.train_peak, p.kv_needed, p.rollout_need) for p in plans]
    if preset.endswith("_1gpu"):
        # the preset's comment states the plan's verdict and margin
        comment = (REPO / "configs" / f"{preset}.yaml").read_text()
        stated = re.search(r"largest update ([\d.]+) GiB: fits\n#\s+([\d.]+) GiB with ([\d.]+) GiB to spare", comment)
        assert stated, f"{preset}.yaml: no 'largest update … fits … to spare' line"
        update, total, spare = stated.groups()
        assert float(total) == gib
        assert f"update phase {update} GiB of {gib:g} GiB ({spare} GiB to spare)" in text


def test_qwen3_4b_instruct_without_max_model_len_is_rejected_naming_the_agent():
    preset = "pair_qwen3-4b_qwen3-4b-instruct_4gpu"
    cfg = _compose(preset, _local_models(preset) + ["actor_rollout_ref.rollout.max_model_len=null"])
    with pytest.raises(ConfigError, match=r"agents\.qwen3_4b_instruct .*max_model_len=262144 needs 36\.0 GiB") as err:
        validate(cfg)
    assert "\n" not in str(err.value)
    # Qwen3-4B's own maximum (40,960 tokens, 5.6 GiB) does fit: only agent 1 is at fault
    plans = planner.plan(cfg, agent_specs(cfg))
    assert plans[0].fits and not plans[1].fits


def test_two_replicas_at_half_the_gpu_on_a_shared_pool_are_rejected():
    preset = "pair_qwen3-4b-base_qwen3-8b-base"
    shared = ["agents.qwen3_4b_base.n_gpus_per_node=0", "agents.qwen3_8b_base.n_gpus_per_node=0"]
    cfg = _compose(preset, _local_models(preset) + shared)
    with pytest.raises(ConfigError, match=r"start-up phase with the other agents of its shared pool needs"):
        validate(cfg)
    # offload alone is not enough: 2 × 0.5 of the GPU plus the processes' own memory
    offload = ["actor_rollout_ref.actor.fsdp_config.param_offload=true",
               "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"]
    with pytest.raises(ConfigError, match=r"start-up phase"):
        validate(_compose(preset, _local_models(preset) + shared + offload))
    # what docs/REPRODUCE.md and run_scripts PLACEMENT=shared set
    validate(_compose(preset, _local_models(preset) + shared + offload
                      + ["actor_rollout_ref.rollout.gpu_memory_utilization=0.35"]))


def test_shared_pool_without_local_shapes_demands_offload_and_a_bounded_share():
    preset = "pair_qwen3-4b-base_qwen3-8b-base"
    # hub ids in no local cache and not among the shipped figures
    shared = ["agents.qwen3_4b_base.model_path=example-org/model-a", "agents.qwen3_8b_base.model_path=example-org/model-b",
              "agents.qwen3_4b_base.n_gpus_per_node=0", "agents.qwen3_8b_base.n_gpus_per_node=0"]
    plans = planner.plan(_compose(preset, shared), agent_specs(_compose(preset, shared)))
    assert not any(p.known for p in plans)
    assert "example-org/model-a: no config.json here" in planner.format_plan(plans, 80)
    with pytest.raises(ConfigError, match=r"a shared pool needs .*param_offload=true"):
        validate(_compose(preset, shared), check_paths=False)
    offload = ["actor_rollout_ref.actor.fsdp_config.param_offload=true",
               "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"]
    with pytest.raises(ConfigError, match=r"0\.5\+0\.5 = 1 of each GPU"):
        validate(_compose(preset, shared + offload), check_paths=False)
    validate(_compose(preset, shared + offload + ["actor_rollout_ref.rollout.gpu_memory_utilization=0.35"]),
             check_paths=False)


def test_update_phase_that_cannot_fit_is_rejected():
    # Qwen3-8B on one GPU: 16 bytes × 8.2 B parameters = 122 GiB of FSDP state
    preset = "pair_qwen3-4b-base_qwen3-8b-base"
    cfg = _compose(preset, _local_models(preset) + ["agents.qwen3_8b_base.n_gpus_per_node=1",
                                                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"])
    specs = agent_specs(cfg)
    plans = planner.plan(cfg, specs)
    assert plans[0].fits and not plans[1].fits
    # + 6.5 GiB of activations (1 row × 5120 tokens, checkpointed) + 2 processes × 1 GiB
    assert any(msg.startswith("update phase needs at least 130.5 GiB") and "activations of a micro-batch about 6.5 GiB"
               in msg for msg in plans[1].problems), plans[1].problems


def test_max_model_len_shorter_than_prompt_plus_response_is_rejected():
    preset = "pair_qwen3-1p7b-base_qwen3-4b-base"
    cfg = _compose(preset, _local_models(preset) + ["actor_rollout_ref.rollout.max_model_len=4096"])
    with pytest.raises(ConfigError, match=r"max_model_len=4096 is shorter than .* = 5120; set it to 5120"):
        validate(cfg)


def test_max_model_len_beyond_the_model_is_rejected():
    preset = "pair_qwen3-1p7b-base_qwen3-4b-base"
    cfg = _compose(preset, _local_models(preset) + ["++agents.qwen3_1p7b_base.actor_rollout_ref.rollout.max_model_len=65536"])
    with pytest.raises(ConfigError, match=r"agents\.qwen3_1p7b_base: .*exceeds .*max_position_embeddings=32768"):
        validate(cfg)


def test_smaller_gpu_memory_key_changes_the_verdict():
    preset = "pair_qwen3-4b_qwen3-4b-instruct"
    validate(_compose(preset, _local_models(preset)))
    with pytest.raises(ConfigError, match=r"of 24 GiB"):
        validate(_compose(preset, _local_models(preset) + ["trainer.gpu_memory_gib=24"]))


def test_trailing_slash_of_a_model_path_is_removed_before_ray():
    preset = "pair_qwen3-1p7b-base_qwen3-4b-base"
    cfg = _compose(preset, [f"agents.qwen3_1p7b_base.model_path={SHAPES / 'Qwen3-1.7B-Base'}/", "agents.qwen3_4b_base.model_path=Qwen/Qwen3-4B-Base/"])
    specs = agent_specs(cfg)
    assert specs[0].model_path == str(SHAPES / "Qwen3-1.7B-Base")
    assert specs[1].model_path == "Qwen/Qwen3-4B-Base"


def test_cpu_rollouts_are_not_memory_checked():
    # the CPU demo uses the `hf` rollout: a 1 MiB "GPU" changes nothing there
    cfg = _compose("hacpo_cpu_demo", ["trainer.gpu_memory_gib=0.001"])
    validate(cfg, check_paths=False)


def _plan_only(preset: str, overrides: list[str], run_dir) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HACPO_")}
    return subprocess.run(
        [sys.executable, "-m", "recipe_hacpo.main", "--config-name", preset, "trainer.plan_only=true",
         f"hydra.run.dir={run_dir}", *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )


def test_plan_only_prints_the_plan_and_starts_nothing(tmp_path):
    preset = "pair_qwen3-4b-base_llama3p2-3b-instruct_4gpu"
    proc = _plan_only(preset, _local_models(preset), tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "- qwen3_4b_base: 4 GPU(s) on 1 node(s), shared pool" in out
    assert "- llama3p2_3b_instruct: 4 GPU(s) on 1 node(s), shared pool" in out
    assert "parameters 4.02 B" in out and "parameters 3.21 B" in out
    assert "offload: params, optimizer" in out and out.count("    fits") == 2
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr


def test_plan_only_exits_non_zero_on_an_impossible_config(tmp_path):
    preset = "pair_qwen3-4b_qwen3-4b-instruct_4gpu"
    proc = _plan_only(preset, _local_models(preset) + ["actor_rollout_ref.rollout.max_model_len=null"], tmp_path)
    assert proc.returncode == 1
    assert "DOES NOT FIT: vLLM KV cache for max_model_len=262144" in proc.stdout
    assert "error: agent qwen3_4b_instruct:" in proc.stderr


def test_plan_only_without_local_models_refuses_vllm_at_5_percent_for_the_8b_model(tmp_path):
    """No model on disk: the shipped figures judge the plan; 5 % of 80 GiB (4 GiB) cannot hold
    Qwen3-8B's 15.3 GiB of bf16 weights: exit 1 with one line naming the agent."""
    proc = _plan_only("pair_qwen3-4b-base_qwen3-8b-base",
                      ["++agents.qwen3_8b_base.actor_rollout_ref.rollout.gpu_memory_utilization=0.05"], tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("not on disk: figures shipped in recipe_hacpo/cluster/model_specs.json") == 2
    assert proc.stdout.count("    fits") == 1  # the 4B agent, at the preset's 0.5
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: agent qwen3_8b_base: vLLM's share gpu_memory_utilization=0.05 × 80.0 GiB = 4.0 GiB does not hold "
        "its 15.3 GiB of weights and 2 GiB of activations, let alone a KV cache; raise "
        "actor_rollout_ref.rollout.gpu_memory_utilization or tensor_model_parallel_size"
    ]


def test_hub_ids_in_the_local_cache_are_planned_without_download(tmp_path, monkeypatch):
    """A hub id is read from the Hugging Face cache layout (refs/main -> snapshots/<rev>/config.json)."""
    from huggingface_hub import constants

    for repo, name in (("Qwen/Qwen3-4B-Base", "Qwen3-4B-Base"), ("Qwen/Qwen3-8B-Base", "Qwen3-8B-Base")):
        root = tmp_path / f"models--{repo.replace('/', '--')}"
        (root / "refs").mkdir(parents=True)
        (root / "refs" / "main").write_text("abc123")
        snapshot = root / "snapshots" / "abc123"
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text((SHAPES / name / "config.json").read_text())
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    cfg = _compose("pair_qwen3-4b-base_qwen3-8b-base")
    plans = planner.plan(cfg, agent_specs(cfg))
    assert [p.known for p in plans] == [True, True]
    assert [round(p.params / 1e9, 2) for p in plans] == [4.02, 8.19]
    # the shared-pool check uses the arithmetic (2 × 0.42 × 80 GiB + processes fits), not the
    # shape-free bound of 0.8 on the summed share (left for models with no figures at all)
    shared = ["agents.qwen3_4b_base.n_gpus_per_node=0", "agents.qwen3_8b_base.n_gpus_per_node=0",
              "actor_rollout_ref.actor.fsdp_config.param_offload=true",
              "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
              "actor_rollout_ref.rollout.gpu_memory_utilization=0.42"]
    validate(_compose("pair_qwen3-4b-base_qwen3-8b-base", shared), check_paths=False)
    assert [p.source for p in plans] == ["config.json on disk"] * 2
    # not in the cache: the shipped figures, the same plan
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    offline = planner.plan(cfg, agent_specs(cfg))
    assert all("model_specs.json" in p.source for p in offline)
    assert [(p.params, p.kv_needed) for p in offline] == [(p.params, p.kv_needed) for p in plans]


@pytest.mark.parametrize("hub_id", sorted(SHIPPED))
def test_shipped_figures_are_the_config_json_and_the_model_card(hub_id):
    """The shipped figures: the same as the model's config.json (fixture), the card's parameter
    count recomputed from them (cards round: 1.7 B is 1.72 B), and a source for each."""
    figures = SHIPPED[hub_id]
    assert figures["source"] == f"https://huggingface.co/{hub_id}/blob/main/config.json"
    fixture = json.loads((SHAPES / hub_id.split("/")[1] / "config.json").read_text())
    for key, value in fixture.items():
        if key not in ("architectures", "attention_bias"):
            assert figures[key] == value, (hub_id, key)
    params = planner.ModelShape.from_config(figures).num_params()
    assert params / 1e9 == pytest.approx(figures["card_parameters_b"], abs=0.03)
    # a path whose last part is the model's name is planned from the same figures
    assert planner.shipped_model_config("/nowhere/" + hub_id.split("/")[1]) == figures
    assert planner.shipped_model_config("/nowhere/Qwen3-99B") is None


@pytest.mark.parametrize("name", sorted(p.name for p in SHAPES.iterdir()))
def test_parameter_count_matches_transformers_own_model(name):
    """The formula against the model transformers builds from the same config.json (meta device: no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(SHAPES / name))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    actual = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    # only Qwen3's per-head q/k norms (2 · head_dim per layer) are left out
    shape = _shape(name)
    left_out = 2 * shape.head_dim * shape.num_layers if cfg.model_type == "qwen3" else 0
    assert actual - shape.num_params() == left_out


def test_planner_imports_nothing_from_config():
    """config.validate calls the planner, so the dependency runs config -> planner only."""
    import ast

    tree = ast.parse((REPO / "recipe_hacpo" / "cluster" / "planner.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m and m.startswith("recipe_hacpo") for m in imported), imported


def test_activation_estimate_by_hand():
    shape = _shape("Qwen3-1.7B-Base")  # h 2048, 16 × 128 q, 8 × 128 kv, I 6144, 28 layers, V 151936
    # one layer: 2 bytes × (4·2048 + 2·2048 + 2·1024 + 4·6144) = 2 × 38912
    assert shape.layer_activation_bytes_per_token() == 77824
    logits = 6 * 151936  # bf16 logits and their fp32 copy
    assert shape.activation_bytes_per_token(checkpointing=False) == 28 * 77824 + logits == 3090688
    # checkpointed: every layer's 2·h input, one layer recomputed at a time
    assert shape.activation_bytes_per_token(checkpointing=True) == 28 * 2 * 2048 + 77824 + logits == 1104128

    preset = "pair_qwen3-1p7b-base_llama3p2-1b-instruct_1gpu"  # 2 rows × (1024 + 4096) tokens a micro-batch
    qwen = planner.plan(_compose(preset), agent_specs(_compose(preset)))[0]
    assert (qwen.micro_tokens, qwen.checkpointing) == (10240, True)
    assert qwen.activations == 10240 * 1104128  # 10.5 GiB
    assert qwen.train_peak == 16 * qwen.params + qwen.activations
    assert qwen.update_need == 4 * GIB + qwen.train_peak  # 2 agents × 2 processes × 1 GiB
    off = _compose(preset, ["actor_rollout_ref.model.enable_gradient_checkpointing=false"])
    assert planner.plan(off, agent_specs(off))[0].activations == 10240 * 3090688  # 29.5 GiB
    # dynamic batch sizes: ppo_max_token_len_per_gpu tokens, split by the Ulysses degree
    dyn = _compose(preset, ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384",
                            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"])
    assert planner.plan(dyn, agent_specs(dyn))[0].micro_tokens == 8192


def test_offload_policy_keeps_fsdp_state_on_the_host():
    preset = "pair_qwen3-0p6b-base_llama3p2-1b-instruct_1gpu"  # fsdp_config.offload_policy=true
    llama = planner.plan(_compose(preset), agent_specs(_compose(preset)))[1]
    assert llama.offload_policy and (llama.fsdp_adam, llama.resident) == (0, 0)
    # bf16 weights and gradients of the root (tied 128256 × 2048 embeddings + final norm) and of
    # two layers (q, o 2048 × 2048; k, v 2048 × 512; MLP 3 × 2048 × 8192; two norms)
    layer = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048
    assert llama.fsdp_weights == llama.fsdp_grads == 2 * (128256 * 2048 + 2048 + 2 * layer)
    assert llama.train_peak == 2 * llama.fsdp_weights + llama.activations
    # on the GPU instead, Llama-3.2-1B's 16 bytes a parameter alone would not fit 24 GiB
    on_gpu = _compose(preset, ["actor_rollout_ref.actor.fsdp_config.offload_policy=false"])
    plans = planner.plan(on_gpu, agent_specs(on_gpu))
    assert any(m.startswith("update phase needs at least 2") for m in plans[1].problems), plans[1].problems


def test_lora_adapter_parameters_by_hand():
    shape = _shape("Qwen3-1.7B-Base")  # h 2048, q 16 × 128, kv 8 × 128, I 6144, 28 layers
    # r · (in + out) per projection: q 2048+2048, k and v 2048+1024, o 2048+2048, gate/up/down 2048+6144
    per_layer = (2048 + 2048) + 2 * (2048 + 1024) + (2048 + 2048) + 3 * (2048 + 6144)
    assert planner.lora_params(shape, 16, "all-linear") == (16 * 28 * per_layer, [])
    assert planner.lora_params(shape, 8, ["q_proj", "v_proj"]) == (8 * 28 * (4096 + 3072), [])
    # a name the plan does not know is reported, not guessed
    assert planner.lora_params(shape, 8, ["q_proj", "lm_head"]) == (8 * 28 * 4096, ["lm_head"])


def test_lora_agent_trains_only_its_adapter_and_its_reference_is_the_actor():
    # Qwen3-8B on one 80 GiB GPU: full fine-tuning needs 16 bytes × 8.2 B parameters (rejected
    # above); with a rank-32 adapter the GPU holds the frozen fp32 base, and grads + Adam of P_r
    preset = "pair_qwen3-4b-base_qwen3-8b-base"
    lora = ["agents.qwen3_8b_base.n_gpus_per_node=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "+agents.qwen3_8b_base.actor_rollout_ref.model.lora_rank=32", "+agents.qwen3_8b_base.actor_rollout_ref.model.target_modules=all-linear",
            "+agents.qwen3_8b_base.actor_rollout_ref.model.lora.merge=true"]
    cfg = _compose(preset, _local_models(preset) + lora)
    full, adapter = planner.plan(cfg, agent_specs(cfg))
    p, pr = adapter.params, adapter.lora_params
    assert full.lora_rank == 0 and full.ref_weights > 0
    assert adapter.lora_rank == 32 and pr == planner.lora_params(_shape("Qwen3-8B-Base"), 32, "all-linear")[0]
    assert 0 < pr < p // 50
    assert (adapter.fsdp_weights, adapter.fsdp_grads, adapter.fsdp_adam) == (4 * (p + pr), 4 * pr, 8 * pr)
    assert adapter.ref_weights == 0  # the actor with its adapter switched off
    assert adapter.vllm_weights == 2 * p  # merged into the base weights before every sync
    assert not any(m.startswith("update phase") for m in adapter.problems), adapter.problems
    text = planner.format_plan([full, adapter], 80)
    assert f"LoRA rank 32: {pr / 1e6:.1f} M trained" in text
    # without merging, vLLM serves the base weights and a bf16 adapter
    unmerged = _compose(preset, _local_models(preset) + lora[:-1] + ["+agents.qwen3_8b_base.actor_rollout_ref.model.lora.merge=false"])
    assert planner.plan(unmerged, agent_specs(unmerged))[1].vllm_weights == 2 * p + 2 * pr
