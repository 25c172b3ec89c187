"""Sampling parameters of the `hf` backend: the vLLM-style dict verl's agent loop sends -> one record.

Requests whose records are equal decode together in one batch (`hf_server`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from verl.workers.config import RolloutConfig

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

