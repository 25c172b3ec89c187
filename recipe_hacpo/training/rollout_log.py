"""What sharing did, row by row: `trainer.rollout_data_dir` (verl's key), one JSONL file per agent
and step.

    <rollout_data_dir>/<agent>/<step>.jsonl    one line per row of the batch that agent trained on

Every line has verl's rollout-dump fields (`input`, `output`, `gts`, `score`, `step`) and the
recipe's: `agent` (the learner), `source` (the agent that generated the response), `cross`
(a peer's row), `uid` (the prompt group), `advantage`, `in_loss` (the row has response tokens
in the loss: false for a peer row outside share_selection=complementary's selection or one
GRAFT's floor dropped), and where the method has them `omega` (ω of the row's source for this
learner, §3), `graft_weight` (GRAFT's w) and `updates`: one entry per optimizer update the row
took part in, `{"m": m, "ratio": s_i, "clipped": bool}`, s_i the sequence ratio the loss used at
that update (own rows: against the learner's old policy; cross rows: against the source, §4) and
`clipped` whether the clip took the row's gradient away there (`core_algos.row_clipped`). The
texts are the learner's tokens decoded without special tokens (a peer's response as the learner
saw it after re-tokenization).

A file is written whole (atomically) after the step's update, so a resumed run rewrites the
files of the steps it repeats and no file is ever half a step.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

from recipe_hacpo import batch_keys as K
from recipe_hacpo.atomic_io import atomic_write_text
from verl import DataProto


def row_updates(record: Sequence[Sequence[dict]]) -> dict[int, list[dict]]:
    """{row id: [{"m", "ratio", "clipped"}, ...]} from a learner's worker record of one step
    (`AgentRuntime.last_update_record`: one list per rank of one dict per mini-batch)."""
    updates: dict[int, list[dict]] = {}
    for rank in record:
        for mini_batch in rank:
            rows = mini_batch.get("rows")
            if not rows:
                continue
            for row, ratio, clipped in zip(rows["row"], rows["ratio"], rows["clipped"]):
                updates.setdefault(int(row), []).append(
                    {"m": int(mini_batch["update_index"]), "ratio": float(ratio), "clipped": bool(clipped)})
    for entries in updates.values():
        entries.sort(key=lambda e: e["m"])
    return updates


def rollout_rows(learner: str, step: int, batch: DataProto, tokenizer, agent_names: Sequence[str],
                 record: Sequence[Sequence[dict]]) -> list[dict]:
    """One dict per row of learner `learner`'s batch of `step` (the fields of the module docstring)."""
    b = batch.batch
    mask = b["response_mask"]
    tokens = mask.sum(-1)
    advantage = ((b["advantages"] * mask).sum(-1) / tokens.clamp(min=1)).tolist()
    inputs = tokenizer.batch_decode(b["prompts"], skip_special_tokens=True)
    outputs = tokenizer.batch_decode(b["responses"], skip_special_tokens=True)
    ground_truth = [rm.get("ground_truth") if isinstance(rm, dict) else None
                    for rm in batch.non_tensor_batch.get("reward_model", [None] * len(batch))]
    updates = row_updates(record)
    optional = {key: b[field].tolist() for key, field in (("omega", K.OMEGA), ("graft_weight", K.GRAFT_WEIGHT))
                if field in b.keys()}
    rows = []
    for i in range(len(batch)):
        row = {
            "input": inputs[i],
            "output": outputs[i],
            "gts": ground_truth[i],
            "score": float(b[K.REWARD][i]),
            "step": int(step),
            "agent": learner,
            "source": agent_names[int(b[K.SOURCE][i])],
            "cross": bool(b[K.IS_CROSS][i]),
            "uid": str(batch.non_tensor_batch["uid"][i]),
            "advantage": float(advantage[i]),
            "in_loss": bool(tokens[i] > 0),
        }
        row.update({key: float(values[i]) for key, values in optional.items()})
        if updates:
            row["updates"] = updates.get(i, [])
        rows.append(row)
    return rows


def write_rollout_log(root: str, learner: str, step: int, rows: list[dict]) -> str:
    """`<root>/<learner>/<step>.jsonl`, written whole; returns its path."""
    path = os.path.join(root, learner, f"{int(step)}.jsonl")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows))
    return path
