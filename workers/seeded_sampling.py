"""Per-row seeded sampling (`rollout.full_determinism`) for the `hf` backend.

Each sampled request gets a seed from its rollout seed, step, verl's `det-<row>` request id and
prompt (`request_seed`), and draws its tokens from its own generator (`SeededRowSampler`), so a
row's sample does not depend on which other requests share its batch, on which replica serves
it, or on whether the run was resumed from a checkpoint.
"""

from __future__ import annotations

import hashlib

import torch
from recipe_hacpo.workers.hf_cpu_rollout.hf_sampling import Sampling


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

    `forced` (a replayed sample tape, `sample_tape.TapeReplay`): row i takes token forced[i][t]
    at decode step t instead of a draw; `warped` still holds this model's own scores, so the
    engine's log-probs are those of the replayed tokens under this model.
    """

    def __init__(self, sampling: Sampling, seeds: list[int], forced: list[list[int]] | None = None):
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
        self.forced = forced
        self.warped: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        self.warped.append(scores)
        if self.forced is not None:
            return self._force(len(self.warped) - 1, scores)
        log_probs = torch.log_softmax(scores.float(), dim=-1)
        tiny = torch.finfo(torch.float32).tiny
        uniform = torch.stack(
            [torch.rand(scores.shape[-1], generator=g).clamp_(min=tiny) for g in self.generators]
        ).to(log_probs.device)
        return log_probs - torch.log(-torch.log(uniform))


    def _force(self, step: int, scores: torch.Tensor) -> torch.Tensor:
        """Scores whose argmax is each row's tape token at `step`. A row past the end of its tape
        has finished (EOS or the token budget) and is padded by HF whatever it is given here."""
        out = torch.full(scores.shape, float("-inf"), dtype=torch.float32, device=scores.device)
        for row, tokens in enumerate(self.forced):
            out[row, tokens[step] if step < len(tokens) else 0] = 0.0
        return out
