"""verl's own PPO trainer config on CPU (the overrides that run it there), for the tests that run verl itself."""

from __future__ import annotations

import os


CPU_OVERRIDES: tuple[str, ...] = (
    # device & trainer stack
    "trainer.device=cpu",
    # the DataProto RayPPOTrainer; the v1 (TransferQueue) stack stalled at start-up here (not investigated)
    "trainer.use_v1=False",
    # actor engine: FSDP2 (FSDP1 refuses CPU), plain attention, no packing, fp32 compute so
    # rollout and actor log-probs agree to ~1e-6
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.model.use_remove_padding=False",
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "actor_rollout_ref.model.enable_gradient_checkpointing=False",
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
    # reference model (only built with use_kl_loss / use_kl_in_reward): verl forces FSDP2
    # CPUOffloadPolicy(pin_memory=True) on a forward_only engine, and pinning needs an
    # accelerator; a non-forward_only ref needs an optim section, borrowed from the actor
    # (its optimizer is built but never stepped)
    "+actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=fp32",
    "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False",
    "actor_rollout_ref.ref.fsdp_config.forward_only=False",
    "+actor_rollout_ref.ref.optim=${actor_rollout_ref.actor.optim}",
    # rollout: HF generate server per FSDP rank, random init, weights arrive by naive sync
    "actor_rollout_ref.rollout.name=hf",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.dtype=float32",
    "actor_rollout_ref.rollout.load_format=dummy",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
    "actor_rollout_ref.rollout.calculate_log_probs=True",
    # few helper actors / processes on a 2-core box
    "actor_rollout_ref.rollout.agent.num_workers=1",
    "reward.num_workers=1",
    "data.dataloader_num_workers=0",
    "+ray_kwargs.ray_init.include_dashboard=False",
)


def ray_overrides(n_workers: int) -> list[str]:
    """Logical GPUs = FSDP ranks. verl's ResourcePoolManager reserves 3 CPUs per GPU bundle
    (`max_colocate_count=3`), so logical CPUs must be >= 3 * n_workers plus headroom for
    the task runner / agent-loop / reward / rollout actors; Ray does not pin real cores."""
    return [
        f"trainer.n_gpus_per_node={n_workers}",
        "trainer.nnodes=1",
        f"+ray_kwargs.ray_init.num_gpus={n_workers}",
        f"ray_kwargs.ray_init.num_cpus={3 * n_workers + 2}",
    ]


def compose_ppo_config(overrides: list[str]):
    """verl's ppo_trainer config with `overrides`, composed in-process (no Ray, no main_ppo)."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)
