"""`hf` rollout backend: Hugging Face `generate` behind verl's server-mode rollout interface.

verl 0.9.1 only generates through rollout servers (vLLM / SGLang / TensorRT-LLM) driven by
the agent loop. This backend plugs into the same three extension points so that the trainer,
agent loop, reward streaming and weight sync run unchanged and only `rollout.name` differs:

- `HFRolloutServer`: one async Ray actor per replica that owns an HF causal LM and answers
  the calls verl's `LLMServerClient` and `RolloutReplica` make on vLLM's server
  (`generate` -> `TokenOutput`, wake_up / sleep / kv-cache / abort / global-steps calls);
- `HFReplica`: the `RolloutReplica` that launches those actors;
- `HFServerAdapter`: the worker-side `BaseRollout` that the FSDP actor worker uses to
  release / resume the server and to push its weights after each update
  (`checkpoint_engine.backend=naive`).

Several agents may run in one Ray job, each with its own replicas; server actors are named
per agent from `rollout.custom.agent_name` (see `server_name_prefix`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import ray
import torch
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, TokenOutput
from verl.workers.rollout.utils import ensure_async_iterator, get_max_position_embeddings

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))

BACKEND_NAME = "hf"

# ---------------------------------------------------------------------------------------
# naming: replica and adapter must agree on the server actor's name
# ---------------------------------------------------------------------------------------


def agent_name_of(config: RolloutConfig | Any) -> str | None:
    """The agent this rollout belongs to, from `rollout.custom.agent_name` (None: single agent)."""
    custom = getattr(config, "custom", None)
    if custom is None and hasattr(config, "get"):
        custom = config.get("custom", None)
    if not custom:
        return None
    name = custom.get("agent_name", None)
    return str(name) if name not in (None, "") else None


def server_name_prefix(config: RolloutConfig | Any) -> str:
    """Ray actor-name prefix of this rollout's servers: `hf_` or `hf_<agent>_`.

    verl names servers `{prefix}server_{replica}_{node}` with replica ranks counted from 0 in
    every worker group, so two agents in one Ray job would both ask for `hf_server_0_0`.
    """
    agent = agent_name_of(config)
    return f"{BACKEND_NAME}_{agent}_" if agent else f"{BACKEND_NAME}_"


def server_actor_name(
    config: RolloutConfig | Any,
    replica_rank: int,
    node_rank: int = 0,
    role: str = "",
    name_suffix: str = "",
) -> str:
    """Full actor name; `role` is "" for the policy, "reward_" / "teacher_" for those models."""
    return f"{server_name_prefix(config)}server_{role}{replica_rank}_{node_rank}{name_suffix}"


def _engine_kwargs(config: RolloutConfig) -> dict:
    """`rollout.engine_kwargs.hf` as a plain dict (absent -> {})."""
    kwargs = (config.engine_kwargs or {}).get(BACKEND_NAME, None) or {}
    return dict(kwargs)


# ---------------------------------------------------------------------------------------
# sampling parameters: the vLLM-style dict the agent loop sends -> one hashable record
# ---------------------------------------------------------------------------------------

# Keys vLLM accepts that change nothing for HF generation here (text rendering, tracing).
_IGNORED_KEYS = frozenset(
    {
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "detokenize",
        "extra_args",
        "output_kind",
    }
)


class HFRolloutUnsupported(ValueError):
    """A request or setting the hf backend does not serve (it says which, and what to use)."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Everything that decides how a request is decoded; requests with equal records batch together."""

    do_sample: bool
    temperature: float | None  # None on greedy
    top_k: int | None  # 0 = disabled (HF convention); None on greedy
    top_p: float | None
    min_p: float | None
    repetition_penalty: float
    max_new_tokens: int
    logprobs: bool
    ignore_eos: bool
    stop_token_ids: tuple[int, ...]
    seed: int | None


def parse_sampling(params: dict[str, Any], config: RolloutConfig, prompt_len: int) -> Sampling:
    """Translate the agent loop's sampling dict; unsupported non-default options are errors.

    Defaults follow verl's vLLM server: the rollout config's temperature/top-k/top-p/repetition
    penalty, and a token budget of min(response_length, prompt_length + response_length -
    len(prompt)) clamped to the room left in `max_model_len`.
    """
    params = dict(params)
    n = params.pop("n", 1)
    if n != 1:
        # verl repeats each prompt `rollout.n` times before the agent loop; one request is one sample.
        raise ValueError(f"hf rollout generates one sequence per request; got n={n}")
    temperature = float(params.pop("temperature", config.temperature))
    top_k = int(params.pop("top_k", config.top_k))
    top_p = float(params.pop("top_p", config.top_p))
    min_p = params.pop("min_p", None)
    repetition_penalty = float(params.pop("repetition_penalty", getattr(config, "repetition_penalty", 1.0)))
    logprobs = bool(params.pop("logprobs", False))
    ignore_eos = bool(params.pop("ignore_eos", getattr(config, "ignore_eos", False)))
    stop_token_ids = tuple(int(t) for t in (params.pop("stop_token_ids", None) or ()))
    seed = params.pop("seed", None)

    if "max_tokens" in params:
        max_tokens = int(params.pop("max_tokens"))
        params.pop("max_new_tokens", None)
    elif "max_new_tokens" in params:
        max_tokens = int(params.pop("max_new_tokens"))
    else:
        max_tokens = min(config.response_length, config.prompt_length + config.response_length - prompt_len)
    room = config.max_model_len - prompt_len
    if room < 1:
        raise ValueError(
            f"prompt of {prompt_len} tokens leaves no room to generate within max_model_len={config.max_model_len}"
        )
    max_tokens = max(1, min(max_tokens, room))

    for key in ("presence_penalty", "frequency_penalty"):
        if float(params.pop(key, 0.0) or 0.0) != 0.0:
            raise ValueError(f"hf rollout does not implement {key}")
    if params.pop("stop", None):
        raise ValueError("hf rollout does not implement stop strings; use stop_token_ids")
    if params.pop("prompt_logprobs", None):
        raise ValueError("hf rollout does not return prompt log-probs")
    unknown = set(params) - _IGNORED_KEYS
    if unknown:
        raise ValueError(f"hf rollout got unsupported sampling params: {sorted(unknown)}")

    # temperature 0 is greedy (as in vLLM); the sampling knobs are then left unset (None)
    # because HF warns about, and ignores, sampling flags on a greedy search.
    do_sample = temperature > 0.0
    return Sampling(
        do_sample=do_sample,
        temperature=temperature if do_sample else None,
        top_k=max(top_k, 0) if do_sample else None,
        top_p=top_p if do_sample else None,
        min_p=float(min_p) if (do_sample and min_p) else None,
        repetition_penalty=repetition_penalty,
        max_new_tokens=max_tokens,
        logprobs=logprobs,
        ignore_eos=ignore_eos,
        stop_token_ids=stop_token_ids,
        seed=None if seed is None else int(seed),
    )


# ---------------------------------------------------------------------------------------
# the model: load, batch-generate, load weights
# ---------------------------------------------------------------------------------------

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclasses.dataclass
class Generated:
    token_ids: list[int]
    log_probs: list[float] | None
    finished: bool  # stopped on an EOS / stop token, not on the token budget


def request_seed(base_seed: int, global_steps: int | None, request_id: str, prompt_ids: list[int]) -> int:
    """A 62-bit sampling seed for one request, the same in every process and on every resume.

    Under `rollout.full_determinism` verl's agent loops name requests by their row in the
    batch (`det-<row>`); with the step and the prompt that pins the request down.
    """
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{int(base_seed)}|{global_steps}|{request_id}|".encode())
    digest.update(",".join(map(str, prompt_ids)).encode())
    return int.from_bytes(digest.digest(), "big") >> 2


class SeededRowSampler:
    """HF logits processor that samples each row from its own generator (Gumbel-max).

    Inside a greedy search it returns log_softmax(warped) + Gumbel noise, whose argmax is a
    draw from softmax(warped); the noise of row i comes from a generator seeded with
    seeds[i] and advanced by one vocabulary-sized draw per decode step. Row i's sample is
    therefore a function of its own prompt, weights and seed, whatever else is batched
    with it. The warpers are HF's own, in the order HF applies them when sampling.
    `warped` keeps the noise-free scores of every step (for `processed_logprobs`).
    """

    def __init__(self, sampling: Sampling, seeds: list[int]):
        from transformers.generation.logits_process import (
            MinPLogitsWarper,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        self.warpers = []
        if sampling.temperature is not None and sampling.temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k:
            self.warpers.append(TopKLogitsWarper(top_k=sampling.top_k))
        if sampling.top_p is not None and sampling.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=sampling.top_p))
        if sampling.min_p is not None:
            self.warpers.append(MinPLogitsWarper(min_p=sampling.min_p))
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        self.warped: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        self.warped.append(scores)
        log_probs = torch.log_softmax(scores.float(), dim=-1)
        tiny = torch.finfo(torch.float32).tiny
        uniform = torch.stack(
            [torch.rand(scores.shape[-1], generator=g).clamp_(min=tiny) for g in self.generators]
        ).to(log_probs.device)
        return log_probs - torch.log(-torch.log(uniform))


class HFEngine:
    """An HF causal LM with batched generation and in-place weight loading.

    Not thread-safe: the server serialises all calls.
    """

    def __init__(self, config: RolloutConfig, model_config: HFModelConfig, seed: int):
        from transformers import AutoModelForCausalLM

        options = _engine_kwargs(config)
        self.device = torch.device(options.get("device", "cpu"))
        self.dtype = _DTYPES[str(config.dtype).lower()]
        self.logprobs_mode = config.logprobs_mode or "processed_logprobs"
        attn = options.get("attn_implementation", "sdpa")
        load_kwargs = dict(dtype=self.dtype, attn_implementation=attn, trust_remote_code=model_config.trust_remote_code)

        torch.manual_seed(seed)
        if "dummy" in config.load_format:
            # Like vLLM's dummy format: random weights of the right shapes; the trainer's first
            # weight sync overwrites every parameter (checked in `finish_weight_update`).
            self.model = AutoModelForCausalLM.from_config(model_config.hf_config, **load_kwargs)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_config.local_path, **load_kwargs)
        self.model.to(self.device).eval()
        # A blank generation config: HF fills every unset field of a request's config from
        # the model's, so a checkpoint default (num_beams, top_k=20, typical_p, ...) would
        # otherwise leak into decoding. EOS ids are collected separately (`_eos_ids`).
        from transformers import GenerationConfig

        self.model.generation_config = GenerationConfig()

        tokenizer = model_config.tokenizer
        self.pad_token_id = _first_int(
            getattr(tokenizer, "pad_token_id", None),
            getattr(model_config.hf_config, "pad_token_id", None),
            getattr(tokenizer, "eos_token_id", None),
            0,
        )
        self.eos_token_ids = _eos_ids(model_config)

        # Every (alias) state-dict name -> live tensor; tied weights share one tensor.
        self._targets = dict(self.model.state_dict(keep_vars=True))
        self._received: set[int] = set()
        self._unknown: list[str] = []

    # -- generation --------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], sampling: Sampling, seeds: list[int | None] | None = None
    ) -> list[Generated]:
        """Decode `prompts` as one left-padded batch.

        `seeds` (one per prompt, or `sampling.seed` for all) makes sampling per row: row i's
        tokens then depend only on its prompt, the weights and seeds[i], not on which other
        requests share the batch (see `SeededRowSampler`). Without seeds, rows draw from the
        process's global torch RNG.
        """
        from transformers import GenerationConfig, LogitsProcessorList

        if seeds is None and sampling.seed is not None:
            seeds = [sampling.seed] * len(prompts)
        row_sampler = None
        if sampling.do_sample and seeds is not None and any(s is not None for s in seeds):
            # rows without a seed of their own draw one from the global RNG
            seeds = [int(torch.randint(2**62, ())) if s is None else s for s in seeds]
            row_sampler = SeededRowSampler(sampling, seeds)
        # As in vLLM, ignore_eos drops the model's EOS but explicit stop_token_ids still stop.
        model_eos = [] if sampling.ignore_eos else self.eos_token_ids
        eos = list(dict.fromkeys(model_eos + list(sampling.stop_token_ids)))

        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            # Left padding: every row's next token sits at the same column.
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1

        # verl's values only: unset fields fall back to the blank model config set in __init__.
        # The row sampler does the sampling inside a greedy search (argmax of perturbed log-probs).
        sample_in_hf = sampling.do_sample and row_sampler is None
        gen_config = GenerationConfig(
            do_sample=sample_in_hf,
            temperature=sampling.temperature if sample_in_hf else None,
            top_k=sampling.top_k if sample_in_hf else None,
            top_p=sampling.top_p if sample_in_hf else None,
            min_p=sampling.min_p if sample_in_hf else None,
            typical_p=1.0,
            repetition_penalty=sampling.repetition_penalty,
            no_repeat_ngram_size=0,
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=0,
            eos_token_id=eos or None,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            output_scores=sampling.logprobs and self.logprobs_mode.startswith("processed"),
            output_logits=sampling.logprobs and self.logprobs_mode.startswith("raw"),
        )
        out = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            generation_config=gen_config,
            logits_processor=LogitsProcessorList([row_sampler]) if row_sampler is not None else None,
        )
        new_tokens = out.sequences[:, width:].cpu()

        per_step = None
        if sampling.logprobs:
            if not self.logprobs_mode.startswith("processed"):
                steps = out.logits
            elif row_sampler is not None:
                steps = row_sampler.warped  # HF's scores hold the perturbed values
            else:
                steps = out.scores
            per_step = self._token_scores(steps, new_tokens)

        stop_set = set(eos)
        results = []
        for row in range(len(prompts)):
            tokens = new_tokens[row].tolist()
            length, finished = len(tokens), False
            for i, tok in enumerate(tokens):
                if tok in stop_set:
                    # Keep the EOS itself: the actor is trained on it, as with vLLM.
                    length, finished = i + 1, True
                    break
            results.append(
                Generated(
                    token_ids=tokens[:length],
                    log_probs=per_step[row, :length].tolist() if per_step is not None else None,
                    finished=finished,
                )
            )
        return results

    def _token_scores(self, steps: tuple[torch.Tensor, ...], tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] score of each generated token: log-prob (`*_logprobs`) or logit (`*_logits`).

        `processed_*` are the logits after temperature / top-k / top-p (HF `scores`), which
        is vLLM's `processed_logprobs`; with top-k and top-p off that is log_softmax(logits / T),
        the quantity verl's actor recomputes. `raw_*` are the model's logits untouched.
        """
        stacked = torch.stack([s.float().cpu() for s in steps], dim=1)  # [B, T, V]
        if self.logprobs_mode.endswith("logprobs"):
            stacked = torch.log_softmax(stacked, dim=-1)
        return stacked.gather(-1, tokens[:, : stacked.shape[1], None]).squeeze(-1)

    # -- weights -----------------------------------------------------------------------

    def begin_weight_update(self) -> None:
        self._received.clear()
        self._unknown.clear()

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_tensors:
            target = self._targets.get(name)
            if target is None:
                self._unknown.append(name)
                continue
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name}: shape {tuple(tensor.shape)} != rollout {tuple(target.shape)}")
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            self._received.add(id(target))

    def finish_weight_update(self) -> None:
        """Fail loudly on a partial sync: a dummy-initialised rollout would silently sample noise."""
        if self._unknown:
            raise KeyError(f"weights unknown to the rollout model: {self._unknown[:8]} ({len(self._unknown)} total)")
        missing = [
            name for name, p in self.model.named_parameters() if id(self._targets.get(name, p)) not in self._received
        ]
        if missing:
            raise KeyError(f"weight sync left rollout parameters untouched: {missing[:8]} ({len(missing)} total)")

    def parameter_checksum(self) -> float:
        """Sum of all parameters (debugging / tests: did a sync change the rollout weights?)."""
        return float(sum(p.detach().double().sum().item() for p in self.model.parameters()))


def _first_int(*candidates) -> int:
    for value in candidates:
        if isinstance(value, int):
            return value
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], int):
            return value[0]
    raise ValueError("no candidate is an int")


def _as_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _eos_ids(model_config: HFModelConfig) -> list[int]:
    """EOS ids as vLLM collects them: the generation config's, the model config's, the tokenizer's."""
    ids: list[int] = []
    if model_config.generation_config is not None:
        ids += _as_list(getattr(model_config.generation_config, "eos_token_id", None))
    ids += _as_list(getattr(model_config.hf_config, "eos_token_id", None))
    ids += _as_list(getattr(model_config.tokenizer, "eos_token_id", None))
    return list(dict.fromkeys(ids))


# ---------------------------------------------------------------------------------------
# the server actor
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Request:
    prompt_ids: list[int]
    sampling: Sampling  # without its seed: requests that differ only in seed share a batch
    seed: int | None
    future: asyncio.Future


class HFRolloutServer:
    """Async Ray actor serving one replica; verl's vLLM server call surface, HF underneath.

    Concurrent `generate` calls are micro-batched: requests that arrive within
    `engine_kwargs.hf.batch_wait_ms` and share a `Sampling` record decode together (left
    padded), up to `max_batch_size` (default `rollout.max_num_seqs`). The model runs in a
    worker thread so control calls stay responsive.

    With `rollout.full_determinism`, each sampled request gets a seed from `request_seed`
    (rollout seed, global step, verl's `det-<row>` request id, prompt) and is sampled from its
    own generator, so a run resumed from a checkpoint draws the same responses as the run it
    continues, however the requests happen to be batched.
    """

    def __init__(
        self,
        config: RolloutConfig,
        model_config: HFModelConfig,
        rollout_mode: RolloutMode,
        replica_rank: int,
        node_rank: int = 0,
        name: str = "",
    ):
        self.config: RolloutConfig = omega_conf_to_dataclass(config)
        self.model_config: HFModelConfig = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        if self.config.max_model_len is None:
            self.config.max_model_len = get_max_position_embeddings(self.model_config.hf_config)
        self.rollout_mode = rollout_mode
        self.replica_rank = replica_rank
        self.node_rank = node_rank
        self.name = name
        options = _engine_kwargs(self.config)
        self._batch_wait_s = float(options.get("batch_wait_ms", 2.0)) / 1000.0
        self._max_batch = int(options.get("max_batch_size", self.config.max_num_seqs))
        if options.get("num_threads"):
            torch.set_num_threads(int(options["num_threads"]))

        self.engine: HFEngine | None = None
        self.global_steps: int | None = None
        # Resident state: verl's naive sync resumes "weights" then "kv_cache"; a request
        # arriving while either is released means the trainer got the phase order wrong.
        self._resident = {"weights": True, "kv_cache": True}

        self._queue: deque[_Request] = deque()
        self._work = asyncio.Event()  # queue non-empty (or being drained)
        self._idle = asyncio.Event()  # nothing queued and no batch running
        self._idle.set()
        self._no_batch = asyncio.Event()  # no batch running (queued requests may wait)
        self._no_batch.set()
        self._weights_consistent = asyncio.Event()  # cleared during a weight update
        self._weights_consistent.set()
        self._gate_open = asyncio.Event()
        self._gate_open.set()
        self._rejecting = False
        self._scheduler: asyncio.Task | None = None

    # -- lifecycle -----------------------------------------------------------------------

    async def launch_server(self) -> None:
        """Build the model (off the event loop: loading can take a while)."""
        seed = self.config.seed + self.replica_rank
        self.engine = await asyncio.to_thread(HFEngine, self.config, self.model_config, seed)
        self._scheduler = asyncio.get_running_loop().create_task(self._schedule())

    def get_server_address(self) -> str:
        return self.name

    def get_rollout_config(self):
        return self.config

    async def ready(self) -> bool:
        return self.engine is not None

    # -- generation --------------------------------------------------------------------

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        audio_data: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        priority: int = 0,
        **kwargs,
    ) -> TokenOutput:
        if image_data or video_data or audio_data:
            raise HFRolloutUnsupported("hf rollout is text-only")
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("empty prompt")
        sampling = parse_sampling(sampling_params, self.config, len(prompt_ids))
        seed = sampling.seed
        if seed is None and sampling.do_sample and self.config.full_determinism:
            # the replica rank is left out on purpose: a request samples the same tokens
            # whichever replica the router sends it to
            seed = request_seed(self.config.seed, self.global_steps, request_id, prompt_ids)
        sampling = dataclasses.replace(sampling, seed=None)

        while not self._gate_open.is_set():
            if self._rejecting:
                return self._aborted()
            await self._gate_open.wait()
        released = [tag for tag, resident in self._resident.items() if not resident]
        if released:
            raise RuntimeError(
                f"{self.name}: generate() while {released} released (sleep); wake the replica or sync weights first"
            )

        future = asyncio.get_running_loop().create_future()
        self._queue.append(_Request(prompt_ids, sampling, seed, future))
        self._idle.clear()
        self._work.set()
        result: Generated | None = await future
        if result is None:
            return self._aborted()
        return TokenOutput(
            token_ids=result.token_ids,
            log_probs=result.log_probs,
            # vLLM's server says "completed" for both EOS and length; here the two are told
            # apart ("length" is what verl's own resume client reports on a spent budget), and
            # `finish_reason` rides along in extra_fields into the DataProto's non_tensor_batch.
            stop_reason="completed" if result.finished else "length",
            num_preempted=0,
            extra_fields={"global_steps": self.global_steps, "finish_reason": "stop" if result.finished else "length"},
        )

    def _aborted(self) -> TokenOutput:
        return TokenOutput(
            token_ids=[], log_probs=None, stop_reason="aborted", extra_fields={"global_steps": self.global_steps}
        )

    async def _schedule(self) -> None:
        """Forever: wait for requests, gather a short window, run one same-`Sampling` batch."""
        while True:
            await self._work.wait()
            await asyncio.sleep(self._batch_wait_s)
            await self._weights_consistent.wait()
            if self._queue:
                await self._run_batch(self._take_batch())
            if not self._queue:
                self._work.clear()
                self._idle.set()

    async def _run_batch(self, batch: list[_Request]) -> None:
        self._no_batch.clear()
        try:
            results = await asyncio.to_thread(
                self.engine.generate, [r.prompt_ids for r in batch], batch[0].sampling, [r.seed for r in batch]
            )
        except Exception as exc:  # every waiting caller gets the error, the server lives on
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(exc)
        else:
            for request, result in zip(batch, results, strict=True):
                if not request.future.done():
                    request.future.set_result(result)
        finally:
            self._no_batch.set()

    def _take_batch(self) -> list[_Request]:
        """The oldest request and every queued request with the same sampling, FIFO, capped."""
        head = self._queue[0].sampling
        batch, rest = [], deque()
        while self._queue:
            request = self._queue.popleft()
            if request.sampling == head and len(batch) < self._max_batch:
                batch.append(request)
            else:
                rest.append(request)
        self._queue = rest
        return batch

    async def wait_for_requests_to_drain(self) -> None:
        await self._idle.wait()

    # -- memory phases (CPU: bookkeeping only; nothing to free) ---------------------------

    async def wake_up(self, tags: list[str] | None = None) -> None:
        for tag in tags or list(self._resident):
            self._resident[tag] = True

    async def sleep(self) -> None:
        if not self.config.free_cache_engine:
            return
        await self._idle.wait()
        for tag in self._resident:
            self._resident[tag] = False

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        await self._idle.wait()

    async def resume_kv_cache(self) -> None:
        return None

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # -- abort / resume (partial rollout, weight sync under async training) ---------------

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        """Close the gate, fail queued requests as aborted, wait for the running batch."""
        self._gate_open.clear()
        self._rejecting = reject_request
        aborted = 0
        while self._queue:
            request = self._queue.popleft()
            if not request.future.done():
                request.future.set_result(None)
                aborted += 1
        await self._no_batch.wait()
        return {"aborted_count": aborted, "request_ids": []}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        # Requests are anonymous once queued (verl sends a fresh id per turn); nothing to match.
        return {"aborted": False, "request_id": request_id}

    async def resume_generation(self) -> None:
        self._rejecting = False
        self._gate_open.set()

    async def start_profile(self, **kwargs) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    # -- weights -----------------------------------------------------------------------

    async def begin_weight_update(self) -> None:
        # Queued requests wait (the scheduler blocks on `_weights_consistent`); only the
        # batch already running must finish before weights change under it.
        self._weights_consistent.clear()
        await self._no_batch.wait()
        self.engine.begin_weight_update()

    async def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        await asyncio.to_thread(self.engine.load_weights, named_tensors)

    async def finish_weight_update(self, global_steps: int | None = None) -> None:
        try:
            self.engine.finish_weight_update()
        finally:
            self._weights_consistent.set()
        if global_steps is not None:
            self.global_steps = global_steps

    async def parameter_checksum(self) -> float:
        return await asyncio.to_thread(self.engine.parameter_checksum)


# ---------------------------------------------------------------------------------------
# the replica (driver side)
# ---------------------------------------------------------------------------------------


class HFReplica(RolloutReplica):
    """Launches one `HFRolloutServer` per replica, next to the replica's first worker."""

    async def launch_servers(self) -> None:
        if self.nnodes != 1:
            raise HFRolloutUnsupported("an hf replica runs in one process; keep tp*dp*pp within one node")
        if not self.workers:
            raise RuntimeError("hf replica has no workers to colocate with")
        node_id = await self.workers[0].__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())

        if self.is_reward_model:
            role = "reward_"
        elif self.is_teacher_model:
            role = "teacher_"
        else:
            role = ""
        name = server_actor_name(self.config, self.replica_rank, 0, role, self.name_suffix)
        server = (
            ray.remote(HFRolloutServer)
            .options(
                name=name,
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node_id=node_id, soft=False
                ),
                max_concurrency=self.max_concurrency,
            )
            .remote(
                config=self.config,
                model_config=self.model_config,
                rollout_mode=self.rollout_mode,
                replica_rank=self.replica_rank,
                node_rank=0,
                name=name,
            )
        )
        await server.launch_server.remote()
        self.servers = [server]
        self._server_handle = server
        # The load balancer keys servers by address; an hf server has no HTTP endpoint, so
        # its unique actor name stands in for one.
        self._server_address = name

    async def sleep(self) -> None:
        await asyncio.gather(*[s.wait_for_requests_to_drain.remote() for s in self.servers])
        await asyncio.gather(*[s.sleep.remote() for s in self.servers])


# ---------------------------------------------------------------------------------------
# the worker-side adapter (inside each FSDP actor rank)
# ---------------------------------------------------------------------------------------


class HFServerAdapter(BaseRollout):
    """`BaseRollout` in the actor worker: controls this rank's server and pushes weights.

    Ranks map to replicas as in vLLM's adapter (`rank // (tp*dp*pp)`); the replica's rank 0
    is its leader and the only one that talks to the server. Every rank still iterates the
    weight generator because the FSDP engine all-gathers each tensor collectively.
    """

    def __init__(self, config: RolloutConfig, model_config: HFModelConfig, device_mesh=None, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        rollout_world_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        rank = int(os.environ.get("RANK", "0"))
        self.replica_rank = rank // rollout_world_size if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % rollout_world_size
        self.server_handle: ray.actor.ActorHandle | None = None
        self._bucket_bytes = max(1, int(self.config.checkpoint_engine.update_weights_bucket_megabytes)) << 20

    @property
    def is_leader_rank(self) -> bool:
        return self.rollout_rank == 0

    def _server(self) -> ray.actor.ActorHandle | None:
        # Resolved lazily: the trainer builds worker groups before it launches the servers.
        if not self.is_leader_rank:
            return None
        if self.server_handle is None:
            self.server_handle = ray.get_actor(server_actor_name(self.config, self.replica_rank))
        return self.server_handle

    async def resume(self, tags: list[str]):
        if self.config.free_cache_engine and self._server() is not None:
            await self.server_handle.wake_up.remote(tags=tags)

    async def release(self):
        if self.config.free_cache_engine and self._server() is not None:
            await self.server_handle.sleep.remote()

    @torch.no_grad()
    async def update_weights(
        self,
        weights,
        global_steps: int | None = None,
        wire_format: str = "named_tensors",
        peft_config=None,
        **kwargs,
    ):
        if wire_format != "named_tensors":
            raise HFRolloutUnsupported(f"hf rollout takes full tensors only; got wire_format={wire_format!r}")
        if peft_config is not None:
            raise HFRolloutUnsupported(
                "hf rollout has no LoRA adapter path; set actor_rollout_ref.model.lora.merge=True"
            )
        server = self._server()
        start = time.time()
        if server is not None:
            await server.begin_weight_update.remote()
        bucket, size = [], 0
        async for name, tensor in ensure_async_iterator(weights):
            if server is None:
                continue  # non-leader: take part in the collective gather, ship nothing
            bucket.append((name, tensor.detach().cpu()))
            size += tensor.numel() * tensor.element_size()
            if size >= self._bucket_bytes:
                await server.load_weights.remote(bucket)
                bucket, size = [], 0
        if server is not None:
            if bucket:
                await server.load_weights.remote(bucket)
            await server.finish_weight_update.remote(global_steps)
            logger.info("hf update_weights replica %d: %.2fs", self.replica_rank, time.time() - start)

    def generate_sequences(self, prompts):
        raise HFRolloutUnsupported("hf rollout generates through its server (agent loop), not in the worker")
