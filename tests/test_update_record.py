"""The HACPO actor update through Ray on CPU (1 and 2 data-parallel ranks): what every
mini-batch of a training step trained on, as recorded by the worker and its loss.

With δ = 0.2, δ_step = 0.025 and 4 updates a step the loss must use the lower bounds 0.8,
0.825, 0.85, 0.875 (m = 0..3, spec §5), every mini-batch on every rank must hold own and
cross rows, and `hacpo/lower_bound` must be the mean over the step's updates. A worker whose
update index never advanced (stepwise clipping silently fixed) fails here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recipe_hacpo import batch_keys as K

pytestmark = [pytest.mark.ray]

PROMPTS, OWN, CROSS, MINI = 8, 2, 2, 2  # 8 prompts, mini-batches of 2 prompts → 4 updates


def _config(model_path: str, dp: int, mode: str):
    from hydra import compose, initialize_config_module

    from recipe_hacpo.config import agent_verl_config, validate

    overrides = [
        f"agents.0.model_path={model_path}", f"agents.1.model_path={model_path}",
        f"agents.0.n_gpus_per_node={dp}", "agents.1.n_gpus_per_node=1",
        f"agents.0.rollout_n={OWN}", f"agents.1.rollout_n={CROSS}",
        f"ray_kwargs.ray_init.num_gpus={dp + 1}",
        f"data.train_batch_size={PROMPTS}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI}",
        # 2 micro-batches per mini-batch on one rank: the bound must agree across them
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MINI * (OWN + CROSS) // dp // 2 or 1}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        f"algorithm.hacpo.mode={mode}",
    ]
    with initialize_config_module("recipe_hacpo.configs", version_base=None):
        cfg = compose("hacpo_cpu_demo", overrides=overrides)
    specs, hacpo = validate(cfg)
    return agent_verl_config(cfg, specs[0]), specs[0], hacpo


def _learner_batch(tokenizer, seed: int = 0):
    """[own rows; cross rows] as the trainer builds it: prompt-major blocks, one uid per prompt."""
    from verl import DataProto

    from recipe_hacpo.exchange import pack_rows

    g = torch.Generator().manual_seed(seed)
    vocab = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    rows = PROMPTS * (OWN + CROSS)
    prompts, responses = [], []
    for _ in range(rows):
        prompts.append([vocab[int(i)] for i in torch.randint(len(vocab), (6,), generator=g)])
        n = int(torch.randint(3, 8, (1,), generator=g))
        responses.append([vocab[int(i)] for i in torch.randint(len(vocab), (n,), generator=g)])
    layout = pack_rows(prompts, responses, pad_id=tokenizer.pad_token_id, prompt_width=32, response_width=8)
    cross = torch.tensor([False] * (PROMPTS * OWN) + [True] * (PROMPTS * CROSS))
    uid = [f"p{p}" for p in range(PROMPTS) for _ in range(OWN)] + [f"p{p}" for p in range(PROMPTS) for _ in range(CROSS)]
    adv = torch.randn(rows, generator=g)
    tensors = dict(layout)
    tensors.update({
        "old_log_probs": torch.zeros(rows, 8),
        "advantages": adv.unsqueeze(-1) * layout["response_mask"],
        K.IS_CROSS: cross,
        K.SOURCE: cross.long(),
        K.OMEGA: torch.where(cross, 1.5, 1.0),
        K.SOURCE_LOG_PROB_MEAN: torch.full((rows,), -3.0),
        K.SOURCE_RESPONSE_LENGTH: layout["response_mask"].sum(-1).float(),
        K.REWARD: torch.zeros(rows),
    })
    return DataProto.from_dict(
        tensors=tensors, non_tensors={"uid": np.array(uid, dtype=object)}, meta_info={"temperature": 1.0}
    )


@pytest.fixture
def ray_cluster():
    import ray

    ray.init(address="local", num_cpus=8, num_gpus=3, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _runtime(agent_cfg, spec, hacpo):
    """The agent's actor worker group (no rollout: the update does not need one)."""
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils import hf_tokenizer

    from recipe_hacpo.agent_runtime import AgentRuntime
    from recipe_hacpo.workers.hacpo_worker import HacpoActorRolloutRefWorker

    OmegaConf_update(agent_cfg)
    runtime = AgentRuntime(spec=spec, config=agent_cfg, device_name="cpu")
    runtime.tokenizer = hf_tokenizer(spec.model_path)
    pool = RayResourcePool(process_on_nodes=[spec.n_gpus_per_node], use_gpu=True, max_colocate_count=1,
                           name_prefix=f"rec_{spec.n_gpus_per_node}")
    cls = RayClassWithInitArgs(
        cls=ray.remote(HacpoActorRolloutRefWorker), config=agent_cfg.actor_rollout_ref, role="actor",
        hacpo_loss=hacpo.loss_kwargs() if hacpo.shares else None,
    )
    runtime.wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, name_prefix="rec", device_name="cpu")
    runtime.wg.init_model()
    return runtime


def OmegaConf_update(agent_cfg) -> None:
    from omegaconf import OmegaConf

    OmegaConf.update(agent_cfg, "actor_rollout_ref.actor.optim.total_training_steps", 1, force_add=True)


@pytest.mark.parametrize("dp", [1, 2])
def test_every_mini_batch_mixes_own_and_cross_rows_and_m_advances(ray_cluster, tiny_agent_paths, dp):
    agent_cfg, spec, hacpo = _config(tiny_agent_paths["qwen2-char-small"], dp, "hacpo")
    runtime = _runtime(agent_cfg, spec, hacpo)
    batch = _learner_batch(runtime.tokenizer)
    own_lp = runtime.old_log_prob(batch)
    batch.batch["old_log_probs"] = torch.where(batch.batch[K.IS_CROSS].unsqueeze(-1), 0.0, own_lp)

    metrics = runtime.update(batch, rows_per_prompt=OWN + CROSS)

    record = runtime.last_update_record
    assert len(record) == dp  # one list per data-parallel rank
    for rank in record:
        assert [e["update_index"] for e in rank] == [0, 1, 2, 3]
        assert [e["lower_bound"] for e in rank] == pytest.approx([0.8, 0.825, 0.85, 0.875])
        for e in rank:
            # whole prompt groups: MINI/dp prompts × (OWN own + CROSS cross) rows on every rank
            assert (e["own_rows"], e["cross_rows"]) == (MINI // dp * OWN, MINI // dp * CROSS)
            assert e["loss_rows"] == e["own_rows"] + e["cross_rows"]  # what the loss saw
    assert metrics["hacpo/updates"] == 4.0
    assert metrics["hacpo/lower_bound"] == pytest.approx(np.mean([0.8, 0.825, 0.85, 0.875]))
    assert metrics["hacpo/min_cross_rows"] > 0 and metrics["hacpo/min_own_rows"] > 0
    assert np.isfinite(metrics["actor/pg_loss"])


def test_isolated_mode_keeps_verl_loss(ray_cluster, tiny_agent_paths):
    agent_cfg, spec, hacpo = _config(tiny_agent_paths["qwen2-char-small"], 1, "isolated")
    runtime = _runtime(agent_cfg, spec, hacpo)
    batch = _learner_batch(runtime.tokenizer)
    keep = ~batch.batch[K.IS_CROSS]
    batch = batch.select_idxs(keep)
    batch.batch["old_log_probs"] = runtime.old_log_prob(batch)
    metrics = runtime.update(batch, rows_per_prompt=OWN)
    record = runtime.last_update_record[0]
    assert [e["update_index"] for e in record] == [0, 1, 2, 3]
    # verl's own loss ran: the HACPO loss (which reports a bound) was never called
    assert all(e["lower_bound"] is None for e in record)
    assert "hacpo/cross_frac" not in metrics and "hacpo/lower_bound" not in metrics
