"""The `agents:` list and the `algorithm.hacpo` block: typed views, per-agent verl configs,
and the one validation pass that rejects a bad configuration before Ray starts.

Every error is one line: the dotted key, the value, the rule, and the fix.
"""

from __future__ import annotations

import copy
import os
from typing import Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from recipe_hacpo.cluster import planner
from recipe_hacpo.agent_spec import AGENTS_FORM, AgentSpec
from recipe_hacpo.hacpo_settings import ConfigError, HacpoSettings
from recipe_hacpo.cluster.placement import master_port_ranges
from recipe_hacpo.rollout_check import RolloutCheck
from recipe_hacpo.workers import sample_tape

__all__ = ["AgentSpec", "ConfigError", "HacpoSettings", "agent_specs", "agent_verl_config", "hacpo_settings", "validate"]


def hacpo_settings(cfg: DictConfig) -> HacpoSettings:
    """`algorithm.hacpo`, typed and checked (`recipe_hacpo.methods.checked_settings`: each key,
    then the rules of its method)."""
    from recipe_hacpo.methods import checked_settings

    return checked_settings(OmegaConf.to_container(cfg.algorithm.get("hacpo", {}), resolve=True) or {})


AGENT_KEYS = {
    "model_path": ("???", "Hugging Face model dir or hub id (its tokenizer and chat template too)"),
    "rollout_n": (8, "G_j: responses per prompt for this agent (`agents_rollout_n` sets every agent's)"),
    "n_gpus_per_node": (0, "GPUs a node of this agent's own resource pool; 0: the shared pool "
                           "(trainer.n_gpus_per_node x trainer.nnodes), the agents on it take turns"),
    "nnodes": (1, "nodes of this agent's own pool"),
    "node_resource": (None, "a custom Ray resource that pins the agent's own pool to the nodes started with it"),
    "actor_rollout_ref": ({}, "any actor_rollout_ref key for this agent only, merged over the shared "
                              "actor_rollout_ref, e.g. {actor: {optim: {lr: 2e-6}}}"),
}
"""What one entry `agents.<name>` may set: (default, meaning) of each key."""

def agents_overrides(entries: Sequence[dict]) -> list[str]:
    """Hydra overrides that replace a preset's agents with `entries` (dicts with a "name" and any
    of AGENT_KEYS), in their order: for scripts and tests that build a set of agents."""

    def value(v) -> str:
        if isinstance(v, dict):
            return "{" + ",".join(f"{k}:{value(x)}" for k, x in v.items()) + "}"
        if isinstance(v, str):
            return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    agents = {e["name"]: {k: v for k, v in e.items() if k != "name"} for e in entries}
    return ["~agents", f"+agents={value(agents)}"]


def agent_specs(cfg: DictConfig) -> list[AgentSpec]:
    """The agents of `agents` (a map from name to entry), in the map's order: the order of the
    preset, then of the command line's additions. Agent j of the spec is the j-th entry."""
    agents = cfg.get("agents")
    if isinstance(agents, (ListConfig, list)):
        raise ConfigError(f"agents: a list; {AGENTS_FORM}")
    if agents is None or len(agents) == 0:
        raise ConfigError(f"agents: empty; {AGENTS_FORM}")
    specs = []
    every_n, every_gpus = cfg.get("agents_rollout_n"), cfg.get("agents_n_gpus_per_node")
    for i, (name, a) in enumerate(agents.items()):
        where = f"agents.{name}"
        if not isinstance(a, DictConfig):
            raise ConfigError(f"{where}: {a!r} is not a map of agent keys; {AGENTS_FORM}")
        unknown = [k for k in a.keys() if k not in AGENT_KEYS and k != "name"]
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}: not an agent key (an agent sets {', '.join(AGENT_KEYS)})")
        if a.get("name") not in (None, str(name)):
            raise ConfigError(f"{where}.name={a.get('name')!r}: an agent's name is its key; drop name or make it {name!r}")
        if OmegaConf.is_missing(a, "model_path") or a.get("model_path") in (None, ""):
            raise ConfigError(f"{where}.model_path: missing; every agent needs a model_path")
        overrides = a.get("actor_rollout_ref") or {}
        specs.append(
            AgentSpec(
                index=i,
                name=str(name),
                model_path=normalize_model_path(str(a.model_path)),
                rollout_n=int(every_n if every_n is not None else a.get("rollout_n", AGENT_KEYS["rollout_n"][0])),
                n_gpus_per_node=int(every_gpus if every_gpus is not None
                                    else a.get("n_gpus_per_node", AGENT_KEYS["n_gpus_per_node"][0])),
                nnodes=int(a.get("nnodes", AGENT_KEYS["nnodes"][0])),
                node_resource=str(a.node_resource) if a.get("node_resource") not in (None, "") else None,
                overrides=OmegaConf.to_container(overrides, resolve=True) if OmegaConf.is_config(overrides) else dict(overrides),
            )
        )
    return specs


def validate(cfg: DictConfig, *, check_paths: bool = True) -> tuple[list[AgentSpec], HacpoSettings]:
    """Reject a configuration that cannot work, before any Ray worker starts."""
    specs = agent_specs(cfg)
    hacpo = hacpo_settings(cfg)

    for s in specs:
        if not s.name.replace("-", "_").isidentifier():
            raise ConfigError(
                f"agents.{s.name}: an agent's name uses letters, digits, '_' or '-' (it is a config key and names "
                "Ray actors and metrics)"
            )
        if s.rollout_n < 1:
            raise ConfigError(f"agents.{s.name}.rollout_n={s.rollout_n}: must be >= 1")
        if s.n_gpus_per_node < 0 or s.nnodes < 1:
            raise ConfigError(
                f"agents.{s.name}: n_gpus_per_node={s.n_gpus_per_node}, nnodes={s.nnodes}: "
                "need n_gpus_per_node >= 0 (0 = shared pool) and nnodes >= 1"
            )
        if s.node_resource is not None and (s.uses_shared_pool or not _is_custom_resource(s.node_resource)):
            raise ConfigError(
                f"agents.{s.name}.node_resource={s.node_resource!r}: "
                + ("needs the agent's own pool (n_gpus_per_node > 0); the shared pool spans every node"
                   if s.uses_shared_pool else
                   "must be a custom Ray resource name (letters, digits, '_', '-', '.'; not CPU, GPU, memory)")
            )
        if check_paths and not _model_path_exists(s.model_path):
            raise ConfigError(
                f"agents.{s.name}.model_path={s.model_path!r}: not a local directory with config.json "
                "and not found in the local Hugging Face cache; download it first or fix the path"
            )
    reward_timeout = float(cfg.trainer.reward_timeout_s)  # default in hacpo_base.yaml
    if not reward_timeout > 0:
        raise ConfigError(f"trainer.reward_timeout_s={reward_timeout}: must be > 0 (seconds one reward call may take)")
    _validate_unhonoured_verl_keys(cfg)
    keep = cfg.trainer.get("max_actor_ckpt_to_keep")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ConfigError(
            f"trainer.max_actor_ckpt_to_keep={keep!r}: the number of newest joint checkpoints kept, >= 1 "
            "(null keeps every checkpoint)"
        )
    from recipe_hacpo.methods import method_for

    method = method_for(hacpo.mode)
    if method.shares and len(specs) < 2 and method.replay_source(hacpo) is None:
        raise ConfigError(
            f"algorithm.hacpo.mode={hacpo.mode}: sharing needs at least 2 agents, got {len(specs)}; "
            "add an agent or use mode=isolated"
        )
    # the method's own checks (its options, its keys, the agents it can train): recipe_hacpo/methods/
    method.options(hacpo)
    method.validate(specs, hacpo, {s.name: data_parallel_world(cfg, s) for s in specs})

    master_port_ranges(cfg.trainer.master_port_range, [s.name for s in specs])  # one line if unusable
    _validate_rollout_check(cfg, specs)
    _validate_sample_tapes(cfg, specs, check_paths)
    from recipe_hacpo.exchange.jobs import exchange_workers

    exchange_workers(cfg.trainer.get("exchange_workers"), len(specs))  # one line if not a thread count
    _validate_layout(cfg, specs, method.shares)
    _validate_pools(cfg, specs)
    _validate_gpu_memory(cfg, specs)
    _validate_vllm_on_cpu(cfg, specs)
    _validate_lora(cfg, specs)
    _validate_attention(cfg, specs)
    return specs, hacpo


def rollout_check(cfg: DictConfig) -> RolloutCheck:
    """`trainer.rollout_check`, typed and checked (recipe_hacpo/rollout_check.py)."""
    node = cfg.trainer.get("rollout_check")
    return RolloutCheck.from_config(OmegaConf.to_container(node, resolve=True) if node is not None else None)


def _validate_rollout_check(cfg: DictConfig, specs: list[AgentSpec]) -> None:
    check = rollout_check(cfg)
    if check.action == "off":
        return
    for s in specs:
        if not bool(s.section(cfg, "rollout").get("calculate_log_probs", False)):
            raise ConfigError(
                f"agents.{s.name}: actor_rollout_ref.rollout.calculate_log_probs=false, but "
                f"trainer.rollout_check.action={check.action} compares the engine's log-probs with the trainer's "
                "every step; set it true (or the action to off)"
            )


# verl trainer keys this recipe's trainer does not act on: {key: (the value that asks for nothing, what to do)}
UNHONOURED_VERL_KEYS = {
    "validation_data_dir": (None, "validation generations are not dumped"),
    "balance_batch": (False, "a learner batch keeps its group order across data-parallel ranks"),
    "default_hdfs_dir": (None, "checkpoints stay under trainer.default_local_dir; copy them from there"),
}


def _validate_unhonoured_verl_keys(cfg: DictConfig) -> None:
    """A verl key that would be accepted and then do nothing is refused instead."""
    for key, (off, instead) in UNHONOURED_VERL_KEYS.items():
        value = cfg.trainer.get(key, off)
        if (value or None) != (off or None):
            raise ConfigError(f"trainer.{key}={value!r}: not honoured by this recipe ({instead}); set it to {off}")


def _validate_sample_tapes(cfg: DictConfig, specs: list[AgentSpec], check_paths: bool) -> None:
    """`trainer.record_samples_dir` / `trainer.replay_samples_dir` (workers/sample_tape.py)."""
    keys = [k for k in ("record_samples_dir", "replay_samples_dir") if cfg.trainer.get(k)]
    for key in keys:
        for s in specs:
            rollout = s.section(cfg, "rollout")
            if str(rollout.get("name")) != "hf" or not bool(rollout.get("full_determinism", False)):
                raise ConfigError(
                    f"trainer.{key} ({s.name}): sample tapes need actor_rollout_ref.rollout.name=hf and "
                    f"rollout.full_determinism=true (the request seed finds a sample); this agent has "
                    f"name={rollout.get('name')}, full_determinism={rollout.get('full_determinism', False)}"
                )
    if check_paths and "replay_samples_dir" in keys:
        root = str(cfg.trainer.replay_samples_dir)
        for s in specs:
            if not sample_tape.tape_files(os.path.join(root, s.name)):
                raise ConfigError(
                    f"trainer.replay_samples_dir={root!r} ({s.name}): no {sample_tape.TAPE_SUFFIX} tape in "
                    f"{os.path.join(root, s.name)}; record one with trainer.record_samples_dir"
                )


def _validate_lora(cfg: DictConfig, specs: list[AgentSpec]) -> None:
    """LoRA agents (`model.lora_rank` > 0): what verl would only find out after Ray is up."""
    for s in specs:
        model = s.section(cfg, "model")
        rank = int(model.get("lora_rank") or 0)
        if rank == 0:
            continue
        where = f"agents.{s.name}.actor_rollout_ref.model"
        if rank < 0 or float(model.get("lora_alpha") or 0) <= 0:
            raise ConfigError(f"{where}: lora_rank={rank}, lora_alpha={model.get('lora_alpha')}: need lora_rank > 0 and lora_alpha > 0")
        if not model.get("target_modules"):
            raise ConfigError(f"{where}.target_modules: empty; name the projections the adapter trains (e.g. all-linear)")
        merged = bool((model.get("lora") or {}).get("merge", False))
        if str(s.section(cfg, "rollout").get("name")) == "hf" and not merged:
            raise ConfigError(
                f"{where}.lora.merge=false with rollout.name=hf: the hf rollout takes merged weights only; "
                "set lora.merge=true (vLLM on GPU also serves the adapter unmerged)"
            )


def _validate_vllm_on_cpu(cfg: DictConfig, specs: list[AgentSpec]) -> None:
    """verl's vLLM rollout on a CPU machine: the environment and every vLLM agent's head size."""
    if str(cfg.trainer.get("device", "cuda")) != "cpu":
        return
    users = [s for s in specs if str(s.section(cfg, "rollout").get("name")) == "vllm"]
    if not users:
        return
    from recipe_hacpo.workers import vllm_cpu

    problem = vllm_cpu.environment_problem()
    if problem:
        raise ConfigError(f"actor_rollout_ref.rollout.name=vllm with trainer.device=cpu ({users[0].name}): {problem}")
    for s in users:
        problem = vllm_cpu.head_size_problem(s.model_path)
        if problem:
            raise ConfigError(f"agents.{s.name}.model_path={s.model_path!r}: {problem}")


# verl's actor, reference and rollout models read the attention kernel from here
# (verl/workers/config/model.py: `override_config.get("attn_implementation", "flash_attention_2")`).
# override_config is an empty struct in the presets: a plain `key=value` override of a key it lacks
# stops Hydra ("Could not override"), so commands add it with `++` (set or add, whichever applies)
ATTN_KEY = "actor_rollout_ref.model.override_config.attn_implementation"
VERL_DEFAULT_ATTN = "flash_attention_2"


def attention_implementation(cfg: DictConfig, spec: AgentSpec) -> str:
    """The attention kernel verl builds this agent's models with (verl's default when unset)."""
    override = spec.section(cfg, "model").get("override_config") or {}
    return str(override.get("attn_implementation") or VERL_DEFAULT_ATTN)


def flash_attn_problem() -> str | None:
    """Why `import flash_attn` fails in this Python (None when it imports).

    Importing, not looking the package up: a flash-attn built against another torch is
    installed yet fails with an undefined symbol, which is the common case after a torch upgrade.
    """
    try:
        import flash_attn  # noqa: F401
    except Exception as exc:  # ImportError, OSError (a missing libcudart), undefined symbols
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no module'}"
    return None


def _validate_attention(cfg: DictConfig, specs: list[AgentSpec]) -> None:
    """The attention kernel each agent's actor is built with, before Ray and vLLM start.

    - flash_attention_2 (verl's default when the key is unset) on a GPU run needs `flash_attn`
      importable; this is checked where this process sees a GPU (the driver runs on a node of
      the job), and otherwise verl fails only once Ray and every vLLM server are up.
    - any other kernel (sdpa, eager) needs `model.use_remove_padding=false`: verl's padding-free
      path packs a micro-batch's sequences into one row and only its flash-attention patch
      keeps them apart; with sdpa every sequence would attend to the ones packed before it.
    """
    gpu_run = str(cfg.trainer.get("device", "cuda")) != "cpu"
    for s in specs:
        attn = attention_implementation(cfg, s)
        where = f"agents.{s.name}"
        if attn.startswith("flash_attention"):
            if gpu_run and _driver_sees_gpu():
                problem = flash_attn_problem()
                if problem:
                    from recipe_hacpo.wheelhouse import FLASH_ATTN_INSTALL

                    raise ConfigError(
                        f"{where}: {ATTN_KEY}={attn}{' (verl default)' if attn == VERL_DEFAULT_ATTN else ''} but flash_attn "
                        f"does not import here ({problem}); install a flash-attn 2.8.3 wheel built for this torch "
                        f"({FLASH_ATTN_INSTALL}) or run without it: ++{ATTN_KEY}=sdpa actor_rollout_ref.model.use_remove_padding=false"
                    )
        elif bool(s.section(cfg, "model").get("use_remove_padding", True)):
            raise ConfigError(
                f"{where}: {ATTN_KEY}={attn} with actor_rollout_ref.model.use_remove_padding=true: verl packs "
                "sequences into one row and only flash attention keeps them apart; set use_remove_padding=false"
            )


def _driver_sees_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _is_custom_resource(name: str) -> bool:
    """A name `ray start --resources` accepts for a resource of the user's own."""
    builtin = {"CPU", "GPU", "NPU", "TPU", "memory", "object_store_memory"}
    return name not in builtin and not name.startswith("node:") and name.replace("-", "_").replace(".", "_").isidentifier()


def normalize_model_path(path: str) -> str:
    """`/models/Qwen3-4B/` -> `/models/Qwen3-4B`: verl asserts on the trailing `/` after Ray is up."""
    return path.rstrip("/") or path


VLLM_ROLLOUTS = ("vllm",)


def _validate_gpu_memory(cfg: DictConfig, specs: list[AgentSpec]) -> None:
    """vLLM agents: max_model_len covers prompt + response, and the memory plan fits.

    The plan (recipe_hacpo/cluster/planner.py) needs each model's config.json; an agent whose
    config.json is not readable locally is checked only where that needs no shape (shared
    pools demand offload and a bounded sum of gpu_memory_utilization). CPU runs (`hf`
    rollout) are not checked.
    """
    vllm = [s for s in specs if str(s.section(cfg, "rollout").name) in VLLM_ROLLOUTS]
    if not vllm:
        return
    needed = int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length)
    for s in vllm:
        max_len = s.section(cfg, "rollout").get("max_model_len")
        if max_len is not None and int(max_len) < needed:
            raise ConfigError(
                f"agents.{s.name}: actor_rollout_ref.rollout.max_model_len={max_len} is shorter than "
                f"data.max_prompt_length + data.max_response_length = {needed}; set it to {needed}"
            )
    for p in planner.plan(cfg, vllm):
        spec = next(s for s in vllm if s.name == p.name)
        if p.known and p.max_model_len > p.shape.max_position_embeddings > 0:
            raise ConfigError(
                f"agents.{p.name}: actor_rollout_ref.rollout.max_model_len={p.max_model_len} exceeds "
                f"the model's max_position_embeddings={p.shape.max_position_embeddings}"
            )
        if p.problems:
            raise ConfigError(
                f"agents.{p.name} on {p.gpus} GPU(s) of {float(cfg.trainer.get('gpu_memory_gib', 80)):g} GiB: "
                f"{p.problems[0]} (trainer.plan_only=true prints the whole plan)"
            )


def _model_path_exists(path: str) -> bool:
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, "config.json"))
    # a hub id is fine only if it is already in the local cache (no download at start-up)
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(path, "config.json"), str)
    except Exception:
        return False


def _validate_batches(cfg: DictConfig, specs: list[AgentSpec]) -> None:
    batch = int(cfg.data.train_batch_size)
    for s in specs:
        actor = s.section(cfg, "actor")
        mini = int(actor.ppo_mini_batch_size)
        if mini < 1 or batch % mini != 0:
            raise ConfigError(
                f"agents.{s.name}: data.train_batch_size={batch} is not divisible by "
                f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}; pick a mini-batch that divides the batch"
            )
        world = data_parallel_world(cfg, s)
        rows_per_mini = mini * _rows_per_prompt(specs, s, cfg)
        if rows_per_mini % world != 0:
            raise ConfigError(
                f"agents.{s.name}: a mini-batch of {rows_per_mini} rows "
                f"(ppo_mini_batch_size {mini} × responses per prompt) does not split over its {world} GPUs; "
                "change ppo_mini_batch_size or rollout_n"
            )
        if actor.get("use_dynamic_bsz", False):
            continue
        # verl's engine splits each GPU's rows into equal micro-batches
        rollout = s.section(cfg, "rollout")
        ref = s.section(cfg, "ref")
        learner_rows = batch * _rows_per_prompt(specs, s, cfg)
        checks = [
            ("actor.ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu, rows_per_mini // world,
             "rows of one mini-batch per GPU"),
            ("rollout.log_prob_micro_batch_size_per_gpu", rollout.log_prob_micro_batch_size_per_gpu,
             batch * s.rollout_n // world, "own responses per GPU (old log-probs)"),
        ]
        if actor.get("use_kl_loss", False):
            checks.append(("ref.log_prob_micro_batch_size_per_gpu", ref.log_prob_micro_batch_size_per_gpu,
                           learner_rows // world, "learner rows per GPU (reference log-probs)"))
        for key, micro, rows, what in checks:
            if micro is not None and (int(micro) < 1 or rows % int(micro) != 0):
                raise ConfigError(
                    f"agents.{s.name}: actor_rollout_ref.{key}={micro} does not divide the {rows} "
                    f"{what}; pick a divisor of {rows}"
                )


def _validate_mixed_mini_batches(cfg: DictConfig, specs: list[AgentSpec]) -> None:
    """Spec §5: every mini-batch, on every data-parallel rank, holds whole prompt groups with
    own and cross rows (see recipe_hacpo.methods.minibatch); verl's row shuffle would break the groups."""
    for s in specs:
        actor = s.section(cfg, "actor")
        if actor.get("shuffle", False):
            raise ConfigError(
                f"agents.{s.name}: actor_rollout_ref.actor.shuffle=true breaks the prompt groups of "
                "HACPO's mini-batches (own and cross rows together); set it to false"
            )
        world = data_parallel_world(cfg, s)
        dp = max(1, world // int(actor.get("ulysses_sequence_parallel_size", 1) or 1))
        mini = int(actor.ppo_mini_batch_size)
        if mini % dp != 0:
            raise ConfigError(
                f"agents.{s.name}: actor_rollout_ref.actor.ppo_mini_batch_size={mini} prompts do not "
                f"split into whole prompt groups over its {dp} data-parallel ranks; use a multiple of {dp}"
            )


def validate_gpu_counts(cfg: DictConfig, specs: list[AgentSpec]) -> None:
    """The checks of `validate` that depend on each agent's GPU count (batch and mini-batch
    divisibility, whole prompt groups per data-parallel rank when sharing, the method's own), for
    a layout `validate` has not seen (the plan's split search); ConfigError on the first failure."""
    from recipe_hacpo.methods import method_for

    hacpo = hacpo_settings(cfg)
    method = method_for(hacpo.mode)
    method.validate(specs, hacpo, {s.name: data_parallel_world(cfg, s) for s in specs})
    _validate_layout(cfg, specs, method.shares)


def _validate_layout(cfg: DictConfig, specs: list[AgentSpec], shares: bool) -> None:
    """How each agent's rows split over its GPUs: batches and micro-batches, and whole prompt
    groups per data-parallel rank when agents share rows."""
    _validate_batches(cfg, specs)
    if shares:
        _validate_mixed_mini_batches(cfg, specs)


def data_parallel_world(cfg: DictConfig, spec: AgentSpec) -> int:
    """The GPUs (data-parallel ranks) an agent's actor runs on."""
    return max(1, spec.n_gpus_per_node * spec.nnodes) if not spec.uses_shared_pool else _shared_world(cfg)


def _rows_per_prompt(specs: list[AgentSpec], learner: AgentSpec, cfg: DictConfig) -> int:
    from recipe_hacpo.methods import method_for

    settings = hacpo_settings(cfg)
    return method_for(settings.mode).rows_per_prompt(specs, learner, settings)


def _shared_world(cfg: DictConfig) -> int:
    return int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes)


def _validate_pools(cfg: DictConfig, specs: list[AgentSpec]) -> None:
    own = sum(s.n_gpus_per_node * s.nnodes for s in specs if not s.uses_shared_pool)
    shared = _shared_world(cfg) if any(s.uses_shared_pool for s in specs) else 0
    total = own + shared
    cluster = _cluster_gpus(cfg)
    if cluster is not None and total > cluster:
        detail = ", ".join(f"{s.name}={s.n_gpus_per_node * s.nnodes}" for s in specs if not s.uses_shared_pool)
        raise ConfigError(
            f"agents: pools need {total} GPUs ({detail}" + (f", shared={shared}" if shared else "")
            + f") but the cluster has {cluster}; shrink n_gpus_per_node or set 0 to share trainer.n_gpus_per_node"
        )


def _cluster_gpus(cfg: DictConfig) -> int | None:
    """GPUs Ray will have: ray_kwargs.ray_init.num_gpus when set (CPU logical GPUs), else None."""
    value = OmegaConf.select(cfg, "ray_kwargs.ray_init.num_gpus", default=None)
    return None if value is None else int(value)


def agent_verl_config(cfg: DictConfig, spec: AgentSpec) -> DictConfig:
    """The full verl config one agent's workers see: the template with the agent merged in."""
    agent_cfg = copy.deepcopy(cfg)
    with open_dict(agent_cfg):
        agent_cfg.actor_rollout_ref = OmegaConf.merge(agent_cfg.actor_rollout_ref, spec.overrides)
        arr = agent_cfg.actor_rollout_ref
        arr.model.path = spec.model_path
        arr.rollout.n = spec.rollout_n
        if not spec.uses_shared_pool:
            agent_cfg.trainer.n_gpus_per_node = spec.n_gpus_per_node
            agent_cfg.trainer.nnodes = spec.nnodes
        custom = {"agent_name": spec.name}
        for key, tape_key in (("record_samples_dir", sample_tape.RECORD_KEY),
                              ("replay_samples_dir", sample_tape.REPLAY_KEY)):
            if cfg.trainer.get(key):
                custom[tape_key] = os.path.join(os.path.abspath(str(cfg.trainer[key])), spec.name)
        arr.rollout.custom = OmegaConf.merge(arr.rollout.get("custom") or {}, custom)
        agent_cfg.trainer.experiment_name = f"{cfg.trainer.experiment_name}/{spec.name}"
        agent_cfg.pop("agents", None)
    return agent_cfg
