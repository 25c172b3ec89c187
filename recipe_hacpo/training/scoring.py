"""Step 2 of spec §7: one verifier scores every agent's responses.

Each agent's responses are decoded with that agent's own tokenizer (a reward worker bound to
one tokenizer could not read a heterogeneous batch), then scored by the configured verl
custom reward function. A reward function that raises or hangs costs that sample a 0 and a
counted metric; training goes on.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import DictConfig, open_dict

from recipe_hacpo import batch_keys as K
from recipe_hacpo.hacpo_settings import ConfigError
from recipe_hacpo.cluster.reliability import call_with_deadlines



def resolve_reward_path(cfg: DictConfig) -> None:
    """Fill `reward.custom_reward_function.path` with the package's math reward when unset."""
    crf = cfg.reward.custom_reward_function
    if not crf.get("path"):
        import recipe_hacpo.reward.math_reward as default_reward

        with open_dict(cfg):
            crf.path = default_reward.__file__
            crf.name = crf.get("name") or "compute_score"
    if not os.path.isfile(crf.path):
        raise ConfigError(f"reward.custom_reward_function.path={crf.path!r}: file not found")


def load_reward_fn(cfg: DictConfig) -> Callable[..., Any]:
    """The configured reward function; ConfigError (one line) when it cannot be loaded."""
    from verl.trainer.ppo.reward import get_custom_reward_fn

    resolve_reward_path(cfg)
    crf = cfg.reward.custom_reward_function
    try:
        fn = get_custom_reward_fn(cfg)
    except Exception as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(
            f"reward.custom_reward_function (path={crf.path!r}, name={crf.get('name')!r}): "
            f"cannot be loaded: {type(exc).__name__}: {detail}"
        ) from exc
    if fn is None:
        raise ConfigError("reward.custom_reward_function: no function could be loaded")
    _check_math_reward_settings(cfg)
    return fn


def _check_math_reward_settings(cfg: DictConfig) -> None:
    """The package's math reward reads `timeout_s` and `isolation` from `reward_kwargs`: reject
    a bad value here, before Ray, instead of failing every sample of the first step."""
    import recipe_hacpo.reward.math_reward as math_reward

    crf = cfg.reward.custom_reward_function
    if os.path.realpath(str(crf.path)) != os.path.realpath(math_reward.__file__):
        return
    kwargs = dict(crf.get("reward_kwargs") or {})
    try:
        math_reward.settings(kwargs)
    except ValueError as exc:
        raise ConfigError(f"reward.custom_reward_function.reward_kwargs.{exc}") from None


@dataclass
class RewardOutcome:
    rewards: torch.Tensor  # float32 [B]
    texts: list[str]  # decoded responses, [B]
    errors: int  # samples whose reward function raised
    timeouts: int  # samples whose reward function did not return in time
    nonfinite: int  # samples whose reward was NaN/inf (scored 0)


class Verifier:
    """Calls the reward function on daemon threads, with a time limit per sample.

    A sample's limit runs from its own start; a call that hangs is abandoned (its thread
    cannot block later samples or the process exit), scored 0 and counted as a timeout.
    """

    def __init__(self, reward_fn: Callable[..., Any], timeout_s: float = 30.0, workers: int = 8) -> None:
        self.reward_fn = _run_to_completion(reward_fn)
        self.timeout_s = timeout_s
        self.workers = workers

    def close(self) -> None:
        """Nothing to release: abandoned calls run on daemon threads."""

    def score(self, batch, tokenizer, texts: list[str] | None = None) -> RewardOutcome:
        """Score a rollout `DataProto` (verl layout: `responses`, `response_mask`).

        texts: `decode_responses(batch, tokenizer)` when already decoded (the trainer decodes in
        the background as the rollouts return, exchange/jobs.py); decoded here otherwise.
        """
        if texts is None:
            texts = decode_responses(batch, tokenizer)
        elif len(texts) != len(batch):
            raise ValueError(f"{len(texts)} decoded responses for a batch of {len(batch)}")
        nt = batch.non_tensor_batch
        calls = []
        for i, text in enumerate(texts):
            rm = nt["reward_model"][i] if "reward_model" in nt else {}
            calls.append(
                functools.partial(
                    self.reward_fn,
                    data_source=str(nt["data_source"][i]) if "data_source" in nt else "",
                    solution_str=text,
                    ground_truth=(rm or {}).get("ground_truth"),
                    extra_info=nt["extra_info"][i] if "extra_info" in nt else None,
                )
            )
        rewards = np.zeros(len(texts), dtype=np.float32)
        errors = timeouts = nonfinite = 0
        for i, result in enumerate(call_with_deadlines(calls, self.timeout_s, self.workers)):
            if result.status == "timeout":
                timeouts += 1
                continue
            if result.status == "error":
                errors += 1
                continue
            value = result.value
            # a reward function that bounds its own work reports failures as a reason, not an
            # exception (math_reward: "timeout", "error:<type>"); count them all the same
            reason = str(value.get("reason", "")) if isinstance(value, dict) else ""
            if reason == "timeout":
                timeouts += 1
                continue
            if reason.startswith("error"):
                errors += 1
                continue
            score = value.get("score", 0.0) if isinstance(value, dict) else value
            try:
                score = float(score)
            except (TypeError, ValueError):
                errors += 1
                continue
            if not np.isfinite(score):
                nonfinite += 1
                continue
            rewards[i] = score
        return RewardOutcome(torch.from_numpy(rewards), texts, errors, timeouts, nonfinite)


def _run_to_completion(fn: Callable[..., Any]) -> Callable[..., Any]:
    """verl accepts `async def` reward functions too: each call then runs its own event loop."""

    def call(**kwargs):
        out = fn(**kwargs)
        return asyncio.run(out) if inspect.iscoroutine(out) else out

    return call


def decode_responses(batch, tokenizer) -> list[str]:
    responses = batch.batch["responses"]
    # ids outside the vocabulary (a model head can be wider than its tokenizer) are dropped
    mask = batch.batch["response_mask"].bool() & (responses >= 0) & (responses < len(tokenizer))
    # no clean-up of spaces: this text is also what crosses to other agents (RESPONSE_TEXT)
    return [
        tokenizer.decode(responses[i][mask[i]].tolist(), skip_special_tokens=True, clean_up_tokenization_spaces=False)
        for i in range(responses.shape[0])
    ]


def attach_rewards(batch, outcome: RewardOutcome) -> None:
    """Store R_i as HACPO's scalar reward and as verl's token-level score (on the last token)."""
    batch.batch[K.REWARD] = outcome.rewards.clone()
    mask = batch.batch["response_mask"]
    scores = torch.zeros(mask.shape, dtype=torch.float32)
    last = (mask.sum(-1) - 1).clamp(min=0).long()
    scores[torch.arange(mask.shape[0]), last] = outcome.rewards
    batch.batch["token_level_scores"] = scores
    batch.batch["token_level_rewards"] = scores
    batch.non_tensor_batch[K.RESPONSE_TEXT] = np.array(outcome.texts, dtype=object)
