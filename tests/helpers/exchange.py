"""A source agent's rollout batch as the trainer hands it to the exchange, and the layout checks of a converted one."""

from __future__ import annotations

from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
import types
import numpy as np
import torch
from tensordict import TensorDict
from verl import DataProto
from verl.utils.model import compute_position_id_with_mask
from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder
from recipe_hacpo import batch_keys
from recipe_hacpo.exchange.retokenize import LAYOUT_KEYS

P_SRC, R_SRC = 48, 40  # the source batch's prompt and response widths


def _pad(tok, ids, width, side):
    """verl's own per-row padding (AgentLoopWorker._pad_token_ids)."""
    return AgentLoopWorker._pad_token_ids(
        types.SimpleNamespace(tokenizer=tok), list(ids), max_length=width, padding_side=side, return_attention_mask=True
    )


def messages(question: str) -> list[dict]:
    return [{"role": "system", "content": "Reason step by step."}, {"role": "user", "content": question}]


def make_source_batch(tok, questions, responses, *, prompt_width=P_SRC, response_width=R_SRC, model_type="qwen2"):
    """A rollout batch as verl's agent loop emits it.

    responses: per row either a str (encoded, EOS appended: a finished response), or a list
    of ids (used as is: an unfinished / hostile response). Rows are cut to response_width.
    """
    builder = create_continuous_token_builder(tok, hf_model_type=model_type)
    rows = {k: [] for k in ("prompts", "responses", "p_att", "r_att")}
    for question, response in zip(questions, responses):
        prompt_ids = builder.build_initial_tokens(messages(question))[-prompt_width:]
        if isinstance(response, str):
            response_ids = tok.encode(response, add_special_tokens=False) + [tok.eos_token_id]
        else:
            response_ids = list(response)
        response_ids = response_ids[:response_width]
        p, r = _pad(tok, prompt_ids, prompt_width, "left"), _pad(tok, response_ids, response_width, "right")
        rows["prompts"].append(p["input_ids"])
        rows["p_att"].append(p["attention_mask"])
        rows["responses"].append(r["input_ids"])
        rows["r_att"].append(r["attention_mask"])
    prompts, responses_t = torch.cat(rows["prompts"]), torch.cat(rows["responses"])
    attention_mask = torch.cat([torch.cat(rows["p_att"]), torch.cat(rows["r_att"])], dim=1)
    bsz = len(questions)
    response_mask = torch.cat(rows["r_att"]).clone()
    batch = TensorDict(
        {
            "prompts": prompts,
            "responses": responses_t,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses_t], dim=1),
            "attention_mask": attention_mask,
            "position_ids": compute_position_id_with_mask(attention_mask),
            "old_log_probs": -torch.rand(bsz, response_width),
            batch_keys.SOURCE: torch.full((bsz,), 1, dtype=torch.int64),
            batch_keys.REWARD: torch.arange(bsz, dtype=torch.float32),
            batch_keys.SOURCE_LOG_PROB_MEAN: -torch.arange(bsz, dtype=torch.float32) / 10,
        },
        batch_size=[bsz],
    )
    raw = np.empty(bsz, dtype=object)
    raw[:] = [messages(q) for q in questions]
    non_tensor = {
        "raw_prompt": raw,
        "uid": np.array([f"uid-{i}" for i in range(bsz)], dtype=object),
        "data_source": np.array(["math"] * bsz, dtype=object),
        "reward_model": np.array([{"ground_truth": str(i)} for i in range(bsz)], dtype=object),
    }
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info={"global_steps": 3})


def valid_response_ids(out: DataProto, i: int) -> list[int]:
    width = out.batch["prompts"].shape[1]
    keep = out.batch["attention_mask"][i, width:].bool()
    return out.batch["responses"][i][keep].tolist()


def valid_prompt_ids(out: DataProto, i: int) -> list[int]:
    width = out.batch["prompts"].shape[1]
    keep = out.batch["attention_mask"][i, :width].bool()
    return out.batch["prompts"][i][keep].tolist()


def assert_layout(out: DataProto, pad_id: int, prompt_width: int, response_width: int):
    """verl's layout invariants: widths, padding sides, concatenation, masks, positions."""
    b = out.batch
    assert b["prompts"].shape[1] == prompt_width and b["responses"].shape[1] == response_width
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], dim=1))
    p_att, r_att = b["attention_mask"][:, :prompt_width], b["attention_mask"][:, prompt_width:]
    # left padding: once a prompt starts it runs to the end; right padding for responses
    assert torch.all(p_att[:, 1:] >= p_att[:, :-1]) and torch.all(r_att[:, 1:] <= r_att[:, :-1])
    assert torch.all(b["prompts"][p_att == 0] == pad_id) and torch.all(b["responses"][r_att == 0] == pad_id)
    assert torch.all(b["response_mask"] <= r_att)
    assert torch.equal(b["position_ids"], compute_position_id_with_mask(b["attention_mask"]))
    for key in LAYOUT_KEYS:
        assert b[key].dtype == torch.int64
