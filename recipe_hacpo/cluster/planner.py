"""GPU memory plan of a HACPO configuration, computed from each model's config.json.

No GPU, no Ray, no download: the numbers come from the model's shape (layers, heads, KV
heads, head dim, vocabulary, MLP width) and the config's placement, offload and vLLM keys.
The shape is read from the model's config.json when the model is on disk (a local directory
or a hub id in the Hugging Face cache); otherwise from the figures shipped in
`recipe_hacpo/cluster/model_specs.json` (the public config.json of every preset's model), and the
plan says which.
`python -m recipe_hacpo.main ... trainer.plan_only=true` prints the plan; `config.validate`
uses the same checks to reject a configuration that cannot fit before Ray starts.

Per GPU of an agent's pool (W GPUs, FSDP shards everything W ways; vLLM tensor parallel T):

- FSDP actor, resident between updates: fp32 master weights 4·P/W (verl's actor loads in
  `model_dtype: fp32`; bf16 is only the compute copy), Adam moments 8·P/W. During an update
  fp32 gradients add 4·P/W: 16·P/W at the peak. `fsdp_config.param_offload` moves weights
  and gradients to host memory between phases, `optimizer_offload` the Adam moments.
  `fsdp_config.offload_policy` (FSDP2's CPUOffloadPolicy) keeps all three on the host and
  steps Adam there: the GPU holds only what is unsharded at once (bf16 weights and gradients
  of the root module, embeddings and LM head, and of two decoder layers, the one computing
  and the one prefetched).
  A reference model (only with a KL term) adds 2·P/W in bf16 unless `ref.fsdp_config.param_offload`.
- A LoRA agent (`model.lora_rank` r > 0) keeps the frozen base weights (4·P/W) and trains only
  the adapter's P_r parameters: r·(in + out) for every targeted projection of every layer
  (`lora_params`); gradients and Adam moments cover P_r only, and the reference policy is the
  actor with the adapter switched off (verl's ref-in-actor), so it costs nothing. vLLM holds
  the merged weights with `model.lora.merge=true`, the base weights and a bf16 adapter without.
- Activations of one micro-batch (an estimate, see `activation_bytes_per_token`): N tokens
  per GPU (ppo_micro_batch_size_per_gpu × (max_prompt_length + max_response_length), or
  ppo_max_token_len_per_gpu with dynamic batch sizes; divided by the Ulysses degree) times
  what each token keeps for the backward pass, plus the LM head's logits. They add to the
  update peak.
- vLLM: reserves `gpu_memory_utilization`·G at start-up (G = the GPU's memory) and keeps it
  while awake. Inside that share: its weights 2·P/T (bf16), a fixed allowance for its
  profiling-run activations and CUDA graphs, and the KV cache in what is left. vLLM refuses
  to start unless one sequence of `max_model_len` tokens fits in that KV cache:
  2 (K and V) · layers · max(1, KV heads/T) · head dim · bytes per element · max_model_len.
- Every process on a GPU (per agent: the FSDP worker and vLLM's engine worker) adds about
  1 GiB of CUDA context and NCCL buffers outside those figures.
- Phases, per GPU of a pool (one replica awake at a time on a shared pool):
  start-up: every member's vLLM share (each replica reserves it before its first sleep) +
  every member's resident actor state.
  rollout of agent j: its vLLM share + every member's resident actor state. An agent of its
  own pool is synced at the end of a step and stays awake until it generates; an agent of
  the shared pool is synced right before its own rollout (recipe_hacpo/training/agent_runtime.py), so
  the other members' replicas are asleep.
  sync of agent j: its replica's weights (woken before the KV cache) + the weights the
  actor hands over: its FSDP weights on the GPU (brought back if offloaded); for a LoRA agent
  the whole model, unsharded, because verl merges the adapter into a full copy before sending
  + one transfer bucket (`rollout.checkpoint_engine.update_weights_bucket_megabytes`) + every
  member's resident state.
  update of agent j: its training peak + the others' resident state (replicas asleep).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

GIB = 1024**3

# bytes per parameter of FSDP state (see the module docstring)
FP32_WEIGHT_BYTES = 4
FP32_GRAD_BYTES = 4
ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32 each
BF16_BYTES = 2

# vLLM's memory inside its share besides weights and KV cache: the activation peak of its
# profiling forward pass (max_num_batched_tokens tokens) and captured CUDA graphs. About
# 1-2 GiB for 1-8B models; 2 GiB keeps the KV estimate on the safe side.
VLLM_NON_KV_GIB = 2.0

# Outside any share: every process on a GPU holds a CUDA context, NCCL buffers and allocator
# slack, roughly 1 GiB each; an agent has two processes on each of its GPUs (the FSDP worker
# and vLLM's engine worker).
PROCESS_OVERHEAD_GIB = 1.0
PROCESSES_PER_AGENT = 2

# rollout.dtype / torch_dtype names -> bytes per element
DTYPE_BYTES = {
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float32": 4, "fp32": 4, "float": 4, "auto": 2,
}


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only model's config.json that memory depends on."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    dtype: str = "bfloat16"

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelShape":
        cfg = cfg.get("text_config", cfg)  # multimodal wrappers keep the LM under text_config
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=int(cfg["vocab_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
            dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        )

    def num_params(self) -> int:
        """P: embeddings + L·(attention + SwiGLU MLP + norms) + final norm (+ LM head if untied).

        attention: q and o are hidden × heads·head_dim, k and v hidden × kv_heads·head_dim;
        MLP: gate, up and down, each hidden × intermediate. Biases are ignored (none in
        Qwen3 / Llama 3); the per-head q/k norms of Qwen3 are within rounding.
        """
        return self.root_params() + self.num_layers * self.layer_params()

    def layer_params(self) -> int:
        """One decoder layer: attention, SwiGLU MLP and its two RMSNorms."""
        h, d = self.hidden_size, self.head_dim
        attention = 2 * h * self.num_heads * d + 2 * h * self.num_kv_heads * d
        return attention + 3 * h * self.intermediate_size + 2 * h

    def root_params(self) -> int:
        """Outside the decoder layers: embeddings, final norm, LM head unless tied."""
        embed = self.vocab_size * self.hidden_size
        return embed + self.hidden_size + (0 if self.tie_word_embeddings else embed)


    def layer_activation_bytes_per_token(self) -> int:
        """bf16 tensors one decoder layer keeps per token for its backward pass (flash attention,
        so nothing quadratic in the sequence length): the inputs of its two RMSNorms and of the
        projections after them (4·h), q, k and v (q + 2·kv), the attention output (q), and the
        SwiGLU MLP's gate, up, SiLU(gate) and their product (4·I)."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return BF16_BYTES * (4 * self.hidden_size + 2 * q + 2 * kv + 4 * self.intermediate_size)

    def activation_bytes_per_token(self, checkpointing: bool) -> int:
        """Activation memory per token of a training micro-batch, an estimate (autograd's own
        bookkeeping, allocator fragmentation and dropout masks are not counted).

        Without gradient checkpointing every layer keeps its tensors: L · layer. With it each
        layer keeps only its input (2·h bytes) and one layer is recomputed at a time during the
        backward pass: L · 2·h + layer. Either way the LM head's logits are kept: bf16 (2·V)
        and the fp32 copy the log-softmax of the log-probs works on (4·V).
        """
        layer = self.layer_activation_bytes_per_token()
        layers = (self.num_layers * BF16_BYTES * self.hidden_size + layer) if checkpointing else self.num_layers * layer
        return layers + (BF16_BYTES + 4) * self.vocab_size


# the projections of a decoder layer that LoRA can target, by their name in Qwen / Llama
# checkpoints; "all-linear" (peft) is every one of them (the LM head is never included)
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_params(shape: "ModelShape", rank: int, target_modules) -> tuple[int, list[str]]:
    """(P_r: the adapter's parameters, the target names it could not count).

    Each targeted projection W (out × in) gets A (r × in) and B (out × r): r·(in + out) per
    layer. `target_modules` is peft's: "all-linear", or a list of module names."""
    h, d, inter = shape.hidden_size, shape.head_dim, shape.intermediate_size
    q, kv = shape.num_heads * d, shape.num_kv_heads * d
    sizes = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h,
             "gate_proj": h + inter, "up_proj": h + inter, "down_proj": inter + h}
    if isinstance(target_modules, str):
        names = list(LORA_PROJECTIONS) if target_modules == "all-linear" else [target_modules]
    else:
        names = [str(n) for n in (target_modules or [])]
    counted = [n for n in names if n in sizes]
    unknown = [n for n in names if n not in sizes]
    return int(rank) * shape.num_layers * sum(sizes[n] for n in dict.fromkeys(counted)), unknown


def kv_bytes_per_token(shape: ModelShape, tp: int = 1, dtype: str = "bfloat16") -> int:
    """KV cache per token on one GPU: 2 · layers · max(1, KV heads / T) · head dim · bytes."""
    kv_heads = max(1, shape.num_kv_heads // max(1, tp))
    return 2 * shape.num_layers * kv_heads * shape.head_dim * DTYPE_BYTES.get(dtype, 2)


SHIPPED_SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_specs.json")


def shipped_model_config(model_path: str) -> dict | None:
    """The shipped figures (model_specs.json) of a hub id, or of a path whose last part is the
    name of a shipped model (`/models/Qwen3-8B-Base` on a machine without that directory); else None."""
    with open(SHIPPED_SPECS, encoding="utf-8") as f:
        models = json.load(f)["models"]
    if model_path in models:
        return models[model_path]
    name = os.path.basename(model_path.rstrip("/"))
    return next((figures for hub_id, figures in models.items() if hub_id.split("/")[-1] == name), None)


def read_model_config(model_path: str) -> dict | None:
    """config.json of a local model dir, or of a hub id already in the local HF cache; else None.

    Never downloads: an id that is not cached locally has no plan.
    """
    if os.path.isdir(model_path):
        path = os.path.join(model_path, "config.json")
    else:
        try:
            from huggingface_hub import try_to_load_from_cache

            path = try_to_load_from_cache(model_path, "config.json")
        except Exception:
            return None
    if not isinstance(path, str) or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@dataclass
class AgentPlan:
    """One agent's estimate, all memory figures in bytes per GPU of its pool."""

    name: str
    pool: str  # "own" or "shared"
    gpus: int  # W: GPUs of the pool (n_gpus_per_node × nnodes)
    nodes: int
    tp: int
    utilization: float
    max_model_len: int | None
    param_offload: bool
    optimizer_offload: bool
    offload_policy: bool = False
    shape: ModelShape | None = None
    params: int = 0
    lora_rank: int = 0
    lora_params: int = 0  # P_r: trainable adapter parameters (0: full fine-tuning)
    fsdp_weights: int = 0
    fsdp_grads: int = 0
    fsdp_adam: int = 0
    checkpoint: int = 0  # bytes of this agent in one joint checkpoint: fp32 weights and Adam state, all ranks
    ref_weights: int = 0
    vllm_share: int = 0
    vllm_weights: int = 0
    kv_budget: int = 0
    kv_needed: int = 0
    micro_tokens: int = 0  # N: tokens of one training micro-batch on one GPU
    checkpointing: bool = False
    activations: int = 0
    rollout_need: int = 0  # per GPU while this agent's replica is awake (set by the pool check)
    update_need: int = 0  # per GPU during this agent's update
    sync_need: int = 0  # per GPU while this agent's weights are sent to its replica
    startup_need: int = 0  # per GPU while the pool's replicas start (each reserves its share)
    sync_staging: int = 0  # the actor's weights on the GPU during the sync (+ the transfer bucket)
    problems: list[str] = field(default_factory=list)
    note: str = ""
    source: str = ""  # where the shape came from

    @property
    def known(self) -> bool:
        return self.shape is not None

    @property
    def resident(self) -> int:
        """Actor state left on the GPU between updates (what offload removes)."""
        if self.offload_policy:
            return self.ref_weights
        weights = 0 if self.param_offload else self.fsdp_weights
        adam = 0 if self.optimizer_offload else self.fsdp_adam
        return weights + adam + self.ref_weights

    @property
    def train_peak(self) -> int:
        """During its own update (offloaded state comes back): 16·P/W (+ ref) + one micro-batch's activations."""
        return self.fsdp_weights + self.fsdp_grads + self.fsdp_adam + self.ref_weights + self.activations

    @property
    def fits(self) -> bool:
        return self.known and not self.problems


def plan_agent(cfg, spec, gpu_memory: int, shape: ModelShape | None) -> AgentPlan:
    """The per-GPU figures of one agent alone (pool interactions come in `plan`).

    `spec` is a `config.AgentSpec`; only its attributes are used, so this module imports
    nothing from config (config.validate calls the planner)."""
    actor = spec.section(cfg, "actor")
    rollout = spec.section(cfg, "rollout")
    if spec.uses_shared_pool:
        gpus, nodes = int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes), int(cfg.trainer.nnodes)
    else:
        gpus, nodes = spec.n_gpus_per_node * spec.nnodes, spec.nnodes
    max_len = rollout.get("max_model_len")
    plan = AgentPlan(
        name=spec.name,
        pool="shared" if spec.uses_shared_pool else "own",
        gpus=gpus,
        nodes=nodes,
        tp=int(rollout.get("tensor_model_parallel_size") or 1),
        utilization=float(rollout.gpu_memory_utilization),
        max_model_len=None if max_len is None else int(max_len),
        param_offload=bool(actor.fsdp_config.get("param_offload", False)),
        optimizer_offload=bool(actor.fsdp_config.get("optimizer_offload", False)),
        offload_policy=bool(actor.fsdp_config.get("offload_policy", False)) and str(actor.get("strategy")) == "fsdp2",
        shape=shape,
    )
    plan.vllm_share = int(plan.utilization * gpu_memory)
    if shape is None:
        plan.note = (f"{spec.model_path}: no config.json here (not a local dir, not in the HF cache, not in "
                     "recipe_hacpo/cluster/model_specs.json); memory not estimated")
        return plan
    if plan.max_model_len is None:
        # verl's vLLM server falls back to the model's maximum context
        plan.max_model_len = shape.max_position_embeddings
    world = max(1, gpus)
    p = plan.params = shape.num_params()
    model = spec.section(cfg, "model")
    plan.lora_rank = int(model.get("lora_rank") or 0)
    if plan.lora_rank > 0:
        plan.lora_params, unknown = lora_params(shape, plan.lora_rank, model.get("target_modules", "all-linear"))
        if unknown:
            plan.note = f"LoRA targets {unknown} not counted (the plan knows {', '.join(LORA_PROJECTIONS)})"
    trained = plan.lora_params if plan.lora_rank > 0 else p
    # what verl's FSDP checkpoint holds (model and optimizer shards), whatever is offloaded
    plan.checkpoint = FP32_WEIGHT_BYTES * (p + plan.lora_params) + ADAM_BYTES * trained
    if plan.offload_policy:
        in_flight = shape.root_params() + 2 * shape.layer_params()
        plan.fsdp_weights = BF16_BYTES * in_flight
        plan.fsdp_grads = BF16_BYTES * in_flight if plan.lora_rank == 0 else BF16_BYTES * trained // world
    else:
        plan.fsdp_weights = FP32_WEIGHT_BYTES * (p + plan.lora_params) // world
        plan.fsdp_grads = FP32_GRAD_BYTES * trained // world
        plan.fsdp_adam = ADAM_BYTES * trained // world
    ref = spec.section(cfg, "ref")
    uses_ref = bool(actor.get("use_kl_loss", False)) or bool(cfg.algorithm.get("use_kl_in_reward", False))
    # a LoRA agent's reference policy is its actor with the adapter off (verl's ref-in-actor)
    if uses_ref and plan.lora_rank == 0 and not bool((ref.get("fsdp_config") or {}).get("param_offload", False)):
        plan.ref_weights = BF16_BYTES * p // world
    plan.micro_tokens = micro_batch_tokens(cfg, actor)
    plan.checkpointing = bool(model.get("enable_gradient_checkpointing", False))
    plan.activations = plan.micro_tokens * shape.activation_bytes_per_token(plan.checkpointing)
    plan.sync_staging = sync_staging_bytes(plan, world, rollout)
    rollout_dtype = str(rollout.get("dtype") or "bfloat16")
    merged = bool((model.get("lora") or {}).get("merge", False))
    adapter = BF16_BYTES * plan.lora_params if plan.lora_rank > 0 and not merged else 0
    plan.vllm_weights = (DTYPE_BYTES.get(rollout_dtype, 2) * p + adapter) // plan.tp
    plan.kv_budget = plan.vllm_share - plan.vllm_weights - int(VLLM_NON_KV_GIB * GIB)
    plan.kv_needed = kv_bytes_per_token(shape, plan.tp, rollout_dtype) * plan.max_model_len
    if plan.kv_budget <= 0:
        plan.problems.append(
            f"vLLM's share gpu_memory_utilization={plan.utilization} × {_gib(gpu_memory)} = {_gib(plan.vllm_share)} "
            f"does not hold its {_gib(plan.vllm_weights)} of weights and {VLLM_NON_KV_GIB:g} GiB of activations, "
            "let alone a KV cache; raise actor_rollout_ref.rollout.gpu_memory_utilization or tensor_model_parallel_size"
        )
    elif plan.kv_needed > plan.kv_budget:
        plan.problems.append(
            f"vLLM KV cache for max_model_len={plan.max_model_len} needs {_gib(plan.kv_needed)} but "
            f"gpu_memory_utilization={plan.utilization} leaves {_gib(max(0, plan.kv_budget))} after "
            f"{_gib(plan.vllm_weights)} of weights; lower actor_rollout_ref.rollout.max_model_len "
            "(prompt + response) or raise gpu_memory_utilization"
        )
    return plan


def sync_staging_bytes(plan: AgentPlan, world: int, rollout) -> int:
    """What the actor holds on one GPU while it sends its weights: its FSDP weights (brought back
    from the host if offloaded; for a LoRA agent the whole base model plus adapter, unsharded,
    since verl merges the adapter into a full copy first) and one transfer bucket."""
    bucket = int(float((rollout.get("checkpoint_engine") or {}).get("update_weights_bucket_megabytes", 2048)) * 2**20)
    if plan.lora_rank > 0:
        return FP32_WEIGHT_BYTES * (plan.params + plan.lora_params) + bucket
    return FP32_WEIGHT_BYTES * plan.params // max(1, world) + bucket


def micro_batch_tokens(cfg, actor) -> int:
    """Tokens of one training micro-batch on one GPU, at the longest rows the data allows."""
    if actor.get("use_dynamic_bsz", False):
        tokens = int(actor.ppo_max_token_len_per_gpu)
    else:
        rows = int(actor.get("ppo_micro_batch_size_per_gpu") or 1)
        tokens = rows * (int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length))
    return tokens // max(1, int(actor.get("ulysses_sequence_parallel_size") or 1))


def model_shape(model_path: str) -> tuple[ModelShape | None, str]:
    """(the model's shape, where it came from): its config.json on disk (a local dir or the
    local HF cache), else the shipped figures; (None, "") when neither has it."""
    raw, source = read_model_config(model_path), "config.json on disk"
    if raw is None:
        raw = shipped_model_config(model_path)
        source = "not on disk: figures shipped in recipe_hacpo/cluster/model_specs.json (the model's public config.json)"
    return (ModelShape.from_config(raw), source) if raw else (None, "")


def plan(cfg, specs, gpu_memory_gib: float | None = None, shapes: dict | None = None) -> list[AgentPlan]:
    """Every agent's plan, with the checks that involve the agents sharing its GPUs.

    `shapes` maps an agent name to a ModelShape (or None); missing names are read from
    config.json (`read_model_config`), else from the shipped figures (`shipped_model_config`).
    """
    gib = float(gpu_memory_gib if gpu_memory_gib is not None else cfg.trainer.get("gpu_memory_gib", 80))
    gpu_memory = int(gib * GIB)
    plans = []
    for s in specs:
        source = "given"
        if shapes is not None and s.name in shapes:
            shape = shapes[s.name]
        else:
            shape, source = model_shape(s.model_path)
        plans.append(plan_agent(cfg, s, gpu_memory, shape))
        plans[-1].source = source if shape is not None else ""

    pools: dict[str, list[AgentPlan]] = {}
    for p in plans:
        pools.setdefault("shared" if p.pool == "shared" else p.name, []).append(p)
    for members in pools.values():
        _check_pool(members, gpu_memory)
    return plans


def _check_pool(members: list[AgentPlan], gpu_memory: int) -> None:
    """Rollout phase: every member's vLLM share + resident actor state at once.
    Update phase of member j: its training peak + the others' resident state (replicas asleep)."""
    shared = len(members) > 1
    known = [m for m in members if m.known]
    if shared and len(known) < len(members):
        # without shapes, demand what makes sharing safe whatever the models are
        total_util = sum(m.utilization for m in members)
        for m in members:
            if not (m.param_offload and m.optimizer_offload):
                m.problems.append(
                    "a shared pool needs actor_rollout_ref.actor.fsdp_config.param_offload=true and "
                    "optimizer_offload=true (every agent's replica reserves its vLLM share at start-up beside the others' "
                    "actors, and each one wakes beside them for its rollout)"
                )
        if total_util > SHARED_UTILIZATION_MAX:
            for m in members:
                m.problems.append(_util_problem(members, total_util))
        return
    if not known:
        return
    overhead = int(PROCESS_OVERHEAD_GIB * GIB) * PROCESSES_PER_AGENT * len(members)
    resident = sum(m.resident for m in members)
    where = "with the other agents of its shared pool " if shared else ""
    # start-up: every replica reserves its share before its first sleep, the actors built first
    startup = overhead + resident + sum(m.vllm_share for m in members)
    for m in members:
        m.startup_need = startup
    if shared and startup > gpu_memory:
        for m in members:
            m.problems.append(
                f"start-up phase {where}needs {_gib(startup)} per GPU (every replica reserves its vLLM share "
                f"{' + '.join(_gib(x.vllm_share) for x in members)} before its first sleep, resident actor "
                f"{' + '.join(_gib(x.resident) for x in members)}, processes {_gib(overhead)}) of {_gib(gpu_memory)}; "
                "set param_offload=true, optimizer_offload=true and lower gpu_memory_utilization"
            )
    for m in members:
        # one replica awake at a time: each agent's rollout and sync see the others asleep
        awake = m.rollout_need = overhead + m.vllm_share + resident
        if awake > gpu_memory:
            m.problems.append(
                f"rollout phase {where}needs {_gib(awake)} per GPU "
                f"(vLLM {_gib(m.vllm_share)}, resident actor {' + '.join(_gib(x.resident) for x in members)}, "
                f"processes {_gib(overhead)}) of {_gib(gpu_memory)}; "
                + ("set param_offload=true, optimizer_offload=true and lower gpu_memory_utilization"
                   if shared else "set fsdp_config.param_offload/optimizer_offload=true or lower gpu_memory_utilization")
            )
    for m in members:
        # the actor's own weights are counted once: in the staging, not also as resident
        own_weights = 0 if (m.param_offload or m.offload_policy) else m.fsdp_weights
        sync = m.sync_need = overhead + resident - own_weights + m.vllm_weights + m.sync_staging
        if sync > gpu_memory:
            m.problems.append(
                f"sync phase {where}needs {_gib(sync)} per GPU (replica weights {_gib(m.vllm_weights)}, actor weights "
                f"and transfer bucket {_gib(m.sync_staging)}"
                + (" (LoRA: the whole merged model)" if m.lora_rank else "")
                + f", resident actor {_gib(resident - own_weights)}, processes {_gib(overhead)}) of {_gib(gpu_memory)}; "
                "use more GPUs for this agent or lower rollout.checkpoint_engine.update_weights_bucket_megabytes"
            )
    for m in members:
        others = sum(x.resident for x in members if x is not m)
        need = m.update_need = overhead + m.train_peak + others
        if need > gpu_memory:
            m.problems.append(
                f"update phase needs at least {_gib(need)} per GPU (FSDP weights+grads+Adam "
                f"{_gib(m.train_peak - m.activations)}, activations of a micro-batch about {_gib(m.activations)}"
                + (f", other agents' resident {_gib(others)}" if others else "")
                + f") of {_gib(gpu_memory)}; use more GPUs for this agent"
            )


# Sum of gpu_memory_utilization over the agents of one shared pool when the models' shapes
# are unknown: what stays for CUDA contexts, NCCL buffers and the one actor being updated.
SHARED_UTILIZATION_MAX = 0.8


def _util_problem(members: list[AgentPlan], total: float) -> str:
    return (
        f"the agents sharing a pool reserve gpu_memory_utilization {'+'.join(str(m.utilization) for m in members)} "
        f"= {total:g} of each GPU, all awake after a weight sync; keep the sum <= {SHARED_UTILIZATION_MAX} "
        f"(e.g. actor_rollout_ref.rollout.gpu_memory_utilization={SHARED_UTILIZATION_MAX / len(members):.2f})"
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def format_plan(plans: list[AgentPlan], gpu_memory_gib: float, keep_checkpoints: int | None = None) -> str:
    """The table `trainer.plan_only=true` prints: one block per agent, then the disk a run's
    checkpoints take (`keep_checkpoints`: trainer.max_actor_ckpt_to_keep, None = every one)."""
    lines = [f"HACPO plan: {len(plans)} agent(s), {gpu_memory_gib:g} GiB per GPU "
             "(activations are an estimate at the longest rows; CUDA context about 1 GiB per process)"]
    for p in plans:
        lines.append(f"- {p.name}: {p.gpus} GPU(s) on {p.nodes} node(s), {p.pool} pool, vLLM TP {p.tp}")
        if not p.known:
            lines.append(f"    {p.note}")
            lines += [f"    DOES NOT FIT: {msg}" for msg in p.problems] or ["    fit not checked"]
            continue
        offload = "FSDP2 offload_policy (weights, grads, Adam on the host)" if p.offload_policy else ", ".join(
            k for k, on in (("params", p.param_offload), ("optimizer", p.optimizer_offload)) if on)
        lines += [
            f"    architecture: {p.source}",
            f"    parameters {p.params / 1e9:.2f} B"
            + (f", LoRA rank {p.lora_rank}: {p.lora_params / 1e6:.1f} M trained" if p.lora_rank else ""),
            f"    FSDP per GPU: weights {_gib(p.fsdp_weights)}, grads {_gib(p.fsdp_grads)}, Adam {_gib(p.fsdp_adam)}"
            + (f", ref {_gib(p.ref_weights)}" if p.ref_weights else "")
            + f"; offload: {offload or 'none'}; resident between updates {_gib(p.resident)}",
            *([f"    {p.note}"] if p.note else []),
            f"    activations of a micro-batch ({p.micro_tokens} tokens, gradient checkpointing "
            f"{'on' if p.checkpointing else 'off'}): about {_gib(p.activations)}; update peak {_gib(p.train_peak)}",
            f"    vLLM per GPU: share {_gib(p.vllm_share)} (gpu_memory_utilization {p.utilization}), weights "
            f"{_gib(p.vllm_weights)}, KV cache {_gib(max(0, p.kv_budget))} "
            f"(one {p.max_model_len}-token sequence needs {_gib(p.kv_needed)})",
        ]
        if p.rollout_need:
            worst = max(p.rollout_need, p.update_need, p.sync_need, p.startup_need)
            lines.append(
                f"    per GPU with processes and the pool's other agents: start-up {_gib(p.startup_need)}, rollout phase {_gib(p.rollout_need)}, "
                f"sync phase {_gib(p.sync_need)}, update phase {_gib(p.update_need)} of {gpu_memory_gib:g} GiB"
                + (f" ({_gib(int(gpu_memory_gib * GIB) - worst)} to spare)" if p.fits else "")
            )
        lines += ["    fits"] if p.fits else [f"    DOES NOT FIT: {msg}" for msg in p.problems]
    if all(p.known for p in plans):
        joint = sum(p.checkpoint for p in plans)
        kept = (f"trainer.max_actor_ckpt_to_keep={keep_checkpoints} keeps at most {_gib(keep_checkpoints * joint)}"
                if keep_checkpoints else "trainer.max_actor_ckpt_to_keep=null keeps every one")
        lines.append(f"checkpoints: {_gib(joint)} a joint checkpoint (fp32 weights and Adam state: "
                     + ", ".join(f"{p.name} {_gib(p.checkpoint)}" for p in plans) + f"); {kept}")
    return "\n".join(lines)
