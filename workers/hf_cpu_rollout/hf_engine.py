"""The `hf` backend's model: an HF causal LM with batched generation and in-place weight loading."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from recipe_hacpo.workers import sample_tape
from recipe_hacpo.workers.hf_cpu_rollout.hf_sampling import Sampling
from recipe_hacpo.workers.seeded_sampling import SeededRowSampler
from recipe_hacpo.workers.vocab_tail import ban_vocab_tail
from verl.workers.config import HFModelConfig, RolloutConfig

BACKEND_NAME = "hf"


def engine_kwargs(config: RolloutConfig) -> dict:
    """`rollout.engine_kwargs.hf` as a plain dict (absent -> {})."""
    kwargs = (config.engine_kwargs or {}).get(BACKEND_NAME, None) or {}
    return dict(kwargs)


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


class HFEngine:
    """An HF causal LM with batched generation and in-place weight loading.

    Not thread-safe: the server serialises all calls.
    """

    def __init__(self, config: RolloutConfig, model_config: HFModelConfig, seed: int):
        from transformers import AutoModelForCausalLM

        options = engine_kwargs(config)
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
        # as verl's vLLM server: output rows beyond the tokenizer's ids are never sampled
        ban_vocab_tail(self.model, tokenizer)
        self.pad_token_id = _first_int(
            getattr(tokenizer, "pad_token_id", None),
            getattr(model_config.hf_config, "pad_token_id", None),
            getattr(tokenizer, "eos_token_id", None),
            0,
        )
        self.eos_token_ids = _eos_ids(model_config)

        # sample tapes (workers/sample_tape.py): this agent's folders, set from trainer keys
        custom = dict(config.custom or {})
        record, replay = custom.get(sample_tape.RECORD_KEY), custom.get(sample_tape.REPLAY_KEY)
        self.tape_recorder = sample_tape.TapeRecorder(record) if record else None
        self.tape_replay = sample_tape.TapeReplay(replay, str(custom.get("agent_name", "agent"))) if replay else None

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
            forced = self.tape_replay.tokens_for(seeds) if self.tape_replay is not None else None
            row_sampler = SeededRowSampler(sampling, seeds, forced)
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
        if row_sampler is not None:
            generated = [r.token_ids for r in results]
            if self.tape_replay is not None:
                self.tape_replay.check_generated(seeds, generated)
            if self.tape_recorder is not None:
                self.tape_recorder.append(seeds, generated)
        return results

    def _token_scores(self, steps: tuple[torch.Tensor, ...], tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] score of each generated token: log-prob (`*_logprobs`) or logit (`*_logits`).

        `processed_*` are the logits after temperature / top-k / top-p (HF `scores`), which
        is vLLM's `processed_logprobs`; with top-k and top-p off that is log_softmax(logits / T),
        the quantity verl's actor recomputes. `raw_*` are the model's logits untouched.
        """
        stacked = torch.stack([s.float().cpu() for s in steps], dim=1)  # [B, T, V]
        picked = stacked.gather(-1, tokens[:, : stacked.shape[1], None]).squeeze(-1)
        if self.logprobs_mode.endswith("logprobs"):
            # as verl's actor on CPU (gather - logsumexp): torch's float32 log_softmax kernel on
            # CPU drops the tiny probabilities of a 152k-id vocabulary (2e-4 nat per token)
            picked = picked - torch.logsumexp(stacked, dim=-1)
        return picked

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

