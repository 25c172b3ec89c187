"""The rows of a learner batch: one agent's rollouts tagged for one learner, and their concatenation.

Every method builds its learner batches from these two: `tag_rows` attaches the per-row fields
the losses read (who generated the row, whether it is a peer's, its ω), `concat_rows` keeps the
keys a learner trains on and stacks own and peer parts.
"""

from __future__ import annotations

import torch

from recipe_hacpo import batch_keys as K
from verl import DataProto

LEARNER_NON_TENSORS = ("uid", "data_source", "reward_model", "raw_prompt", "extra_info", K.RESPONSE_TEXT)
"""Non-tensor keys a learner batch keeps (those every part has)."""

LEARNER_TENSORS = (
    "prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids",
    "old_log_probs", K.REWARD, K.SOURCE, K.IS_CROSS, K.OMEGA, K.SOURCE_LOG_PROB_MEAN, K.SOURCE_RESPONSE_LENGTH,
)
"""Tensor keys every learner batch holds."""

def tag_rows(batch: DataProto, *, source: int, cross: bool, omega: float) -> DataProto:
    """Attach the per-row HACPO fields to one agent's rows, as seen by one learner."""
    b = len(batch)
    batch.batch[K.SOURCE] = torch.full((b,), source, dtype=torch.long)
    batch.batch[K.IS_CROSS] = torch.full((b,), cross, dtype=torch.bool)
    batch.batch[K.OMEGA] = torch.full((b,), omega, dtype=torch.float32)
    if cross or "old_log_probs" not in batch.batch.keys():
        # cross rows use the source's mean log-prob (§4), never the learner's old log-probs
        batch.batch["old_log_probs"] = torch.zeros(batch.batch["responses"].shape, dtype=torch.float32)
    return batch


def concat_rows(parts: list[DataProto], fields: tuple[str, ...] = ()) -> DataProto:
    """Concatenate own and cross rows on the keys a learner trains on: `LEARNER_TENSORS` and, of
    the method's own `fields` (`Method.batch_fields`), those the parts carry."""
    trimmed = []
    for p in parts:
        tensors = {k: p.batch[k] for k in LEARNER_TENSORS}
        tensors.update({k: p.batch[k] for k in fields if k in p.batch.keys()})
        non_tensors = {k: p.non_tensor_batch[k] for k in LEARNER_NON_TENSORS if k in p.non_tensor_batch}
        trimmed.append(DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=dict(parts[0].meta_info)))
    keys = set.intersection(*(set(t.non_tensor_batch) for t in trimmed))
    for t in trimmed:
        for k in list(t.non_tensor_batch):
            if k not in keys:
                t.non_tensor_batch.pop(k)
    return DataProto.concat(trimmed)
