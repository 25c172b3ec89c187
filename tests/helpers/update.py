"""A learner batch, an agent's verl config and its runtime for the actor-update tests through Ray."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from recipe_hacpo import batch_keys as K


PROMPTS, OWN, CROSS, MINI = 8, 2, 2, 2  # 8 prompts, mini-batches of 2 prompts → 4 updates


def _set_total_steps(agent_cfg) -> None:
    from omegaconf import OmegaConf

    OmegaConf.update(agent_cfg, "actor_rollout_ref.actor.optim.total_training_steps", 1, force_add=True)


def learner_config(model_path: str, dp: int, mode: str, extra: tuple[str, ...] = ()):
    from hydra import compose, initialize_config_module

    from recipe_hacpo.config import agent_verl_config, validate

    overrides = [
        f"agents.qwen_char.model_path={model_path}", f"agents.llama_pair.model_path={model_path}",
        f"agents.qwen_char.n_gpus_per_node={dp}", "agents.llama_pair.n_gpus_per_node=1",
        f"agents.qwen_char.rollout_n={OWN}", f"agents.llama_pair.rollout_n={CROSS}",
        f"ray_kwargs.ray_init.num_gpus={dp + 1}",
        f"data.train_batch_size={PROMPTS}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI}",
        # 2 micro-batches per mini-batch on one rank: the bound must agree across them
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MINI * (OWN + CROSS) // dp // 2 or 1}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        f"algorithm.hacpo.mode={mode}",
        *extra,
    ]
    with initialize_config_module("recipe_hacpo.configs", version_base=None):
        cfg = compose("hacpo_cpu_demo", overrides=overrides)
    specs, hacpo = validate(cfg)
    return agent_verl_config(cfg, specs[0]), specs[0], hacpo


def learner_batch(tokenizer, seed: int = 0):
    """[own rows; cross rows] as the trainer builds it: prompt-major blocks, one uid per prompt."""
    from verl import DataProto

    from recipe_hacpo.exchange.retokenize import pack_rows

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


def agent_runtime(agent_cfg, spec, hacpo):
    """The agent's actor worker group (no rollout: the update does not need one)."""
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils import hf_tokenizer

    from recipe_hacpo.methods import loss_settings
    from recipe_hacpo.training.agent_runtime import AgentRuntime
    from recipe_hacpo.workers.hacpo_worker import HacpoActorRolloutRefWorker

    _set_total_steps(agent_cfg)
    runtime = AgentRuntime(spec=spec, config=agent_cfg, device_name="cpu")
    runtime.tokenizer = hf_tokenizer(spec.model_path)
    pool = RayResourcePool(process_on_nodes=[spec.n_gpus_per_node], use_gpu=True, max_colocate_count=1,
                           name_prefix=f"rec_{spec.n_gpus_per_node}")
    cls = RayClassWithInitArgs(
        cls=ray.remote(HacpoActorRolloutRefWorker), config=agent_cfg.actor_rollout_ref, role="actor",
        hacpo_loss=loss_settings(hacpo),
    )
    runtime.wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, name_prefix="rec", device_name="cpu")
    runtime.wg.init_model()
    return runtime
