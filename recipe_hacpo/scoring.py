"""Step 2 of spec §7: one verifier scores every agent's responses.

Each agent's responses are decoded with that agent's own tokenizer (a reward worker bound to
one tokenizer could not read a heterogeneous batch), then scored by the configured verl
custom reward function. A reward function that raises or hangs costs that sample a 0 and a
counted metric; training goes on.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import DictConfig, open_dict

from recipe_hacpo import batch_keys as K



def resolve_reward_path(cfg: DictConfig) -> None:
    """Fill `reward.custom_reward_function.path` with the package's math reward when unset."""
    crf = cfg.reward.custom_reward_function
    if not crf.get("path"):
        import recipe_hacpo.reward.math_reward as default_reward

        with open_dict(cfg):
            crf.path = default_reward.__file__
            crf.name = crf.get("name") or "compute_score"
    if not os.path.isfile(crf.path):
        raise FileNotFoundError(f"reward.custom_reward_function.path={crf.path!r}: file not found")


def load_reward_fn(cfg: DictConfig) -> Callable[..., Any]:
    from verl.trainer.ppo.reward import get_custom_reward_fn

    resolve_reward_path(cfg)
    fn = get_custom_reward_fn(cfg)
    if fn is None:
        raise ValueError("reward.custom_reward_function: no function could be loaded")
    return fn


@dataclass
class RewardOutcome:
    rewards: torch.Tensor  # float32 [B]
    texts: list[str]  # decoded responses, [B]
    errors: int  # samples whose reward function raised
    timeouts: int  # samples whose reward function did not return in time
    nonfinite: int  # samples whose reward was NaN/inf (scored 0)


class Verifier:
    """Calls the reward function on a thread pool, with a time limit per sample."""

    def __init__(self, reward_fn: Callable[..., Any], timeout_s: float = 30.0, workers: int = 8) -> None:
        self.reward_fn = reward_fn
        self.timeout_s = timeout_s
        self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hacpo-reward")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def score(self, batch, tokenizer) -> RewardOutcome:
        """Score a rollout `DataProto` (verl layout: `responses`, `response_mask`)."""
        texts = decode_responses(batch, tokenizer)
        nt = batch.non_tensor_batch
        futures = []
        for i, text in enumerate(texts):
            rm = nt["reward_model"][i] if "reward_model" in nt else {}
            futures.append(
                self._pool.submit(
                    self.reward_fn,
                    data_source=str(nt["data_source"][i]) if "data_source" in nt else "",
                    solution_str=text,
                    ground_truth=(rm or {}).get("ground_truth"),
                    extra_info=nt["extra_info"][i] if "extra_info" in nt else None,
                )
            )
        rewards = np.zeros(len(texts), dtype=np.float32)
        errors = timeouts = nonfinite = 0
        for i, fut in enumerate(futures):
            try:
                value = fut.result(timeout=self.timeout_s)
            except cf.TimeoutError:
                timeouts += 1
                continue
            except Exception:
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


def decode_responses(batch, tokenizer) -> list[str]:
    responses = batch.batch["responses"]
    mask = batch.batch["response_mask"].bool()
    return [
        tokenizer.decode(responses[i][mask[i]].tolist(), skip_special_tokens=True) for i in range(responses.shape[0])
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
