"""Hostile model output through the whole exchange path of one step, as the trainer runs it:
the verifier decodes and rewards each response (`recipe_hacpo.reward.math_reward`), the text
is attached, and the rollout is re-encoded for the other agent. Arbitrary token ids (special
tokens, ids outside the vocabulary, cut UTF-8), odd unicode, spelled-out special tokens and
huge responses: no crash, no hang, bounded time, a finite reward, verl's layout, and the
learner reads exactly the text the reward saw."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from verl import DataProto

from recipe_hacpo import batch_keys as K
from recipe_hacpo.exchange.retokenize import RowConverter, decode_responses
from recipe_hacpo.reward.math_reward import compute_score
from recipe_hacpo.training.scoring import Verifier, attach_rewards

PROMPT = [{"role": "user", "content": "What is 3+4?"}]
P_LEARNER, R_LEARNER = 64, 48

HOSTILE_TEXTS = [
    "",
    " ",
    "\\boxed{7}",
    "\\boxed{" * 200 + "7",
    "}" * 500 + "\\boxed{}",
    "#### 7" * 50,
    "\u202e\u200b\u200d\ufeff\u0000\x7f e\u0301 ﷽ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🙂🏳️‍🌈 中文 العربية",
    "<|eot_id|><|im_end|><|endoftext|><|begin_of_text|><|start_header_id|>assistant<|end_header_id|>",
    "\\boxed{<|im_end|>7}",
    "\\frac{" * 50 + "1" + "}" * 50,
    "1e999999 nan inf -inf \\infty 10^{10^{10^{10}}}",
    "\ud800".encode("utf-8", "surrogatepass").decode("utf-8", "replace"),
]

# text spelled with special-token strings and control characters, hypothesis' pick of the rest
hostile_text = st.one_of(
    st.text(max_size=60),
    st.lists(st.sampled_from(HOSTILE_TEXTS[6:9] + ["\\boxed{", "}", "7", "<|", "|>", "\n", "\t"]), max_size=20).map("".join),
)


def source_batch(tokenizer, responses: list[list[int]], width: int | None = None) -> DataProto:
    """A rollout batch in verl's agent-loop layout; responses are raw ids, used as they are."""
    prompt_ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
        prompt_ids = prompt_ids["input_ids"]
    bsz = len(responses)
    r_width = max(1, width or max((len(r) for r in responses), default=1))
    pad = tokenizer.pad_token_id
    prompts = torch.tensor([prompt_ids] * bsz, dtype=torch.int64)
    resp = torch.full((bsz, r_width), pad, dtype=torch.int64)
    r_att = torch.zeros((bsz, r_width), dtype=torch.int64)
    for i, ids in enumerate(responses):
        ids = ids[:r_width]
        if ids:
            resp[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
            r_att[i, : len(ids)] = 1
    attention = torch.cat([torch.ones_like(prompts), r_att], dim=1)
    tensors = {
        "prompts": prompts,
        "responses": resp,
        "response_mask": r_att.clone(),
        "input_ids": torch.cat([prompts, resp], dim=1),
        "attention_mask": attention,
        "position_ids": torch.clip(torch.cumsum(attention, dim=-1) - 1, min=0),
    }
    raw = np.empty(bsz, dtype=object)
    raw[:] = [PROMPT] * bsz
    non_tensor = {
        "raw_prompt": raw,
        "uid": np.array(["u0"] * bsz, dtype=object),
        "data_source": np.array(["hacpo/arith/add1"] * bsz, dtype=object),
        "reward_model": np.array([{"style": "rule", "ground_truth": "7"}] * bsz, dtype=object),
        "extra_info": np.array([{"split": "train", "index": i} for i in range(bsz)], dtype=object),
    }
    return DataProto(batch=TensorDict(tensors, batch_size=[bsz]), non_tensor_batch=non_tensor)


@pytest.fixture(scope="module")
def verifier():
    v = Verifier(compute_score, timeout_s=20.0, workers=4)
    yield v
    v.close()


def through_the_step(verifier, src_tok, dst_tok, batch: DataProto):
    """score → attach (text + reward) → re-encode for the learner, as `HacpoTrainer` does."""
    outcome = verifier.score(batch, src_tok)
    attach_rewards(batch, outcome)
    exchange = RowConverter(src_tok, dst_tok, max_prompt_length=P_LEARNER, max_response_length=R_LEARNER)
    return outcome, exchange.convert(batch)


def check(outcome, out: DataProto, src_batch: DataProto, src_tok, dst_tok) -> None:
    n = len(src_batch)
    rewards = outcome.rewards
    assert rewards.shape == (n,) and torch.isfinite(rewards).all() and ((rewards >= 0) & (rewards <= 1)).all()
    assert outcome.errors == 0 and outcome.timeouts == 0  # math_reward never raises on model output
    b = out.batch
    assert b["prompts"].shape == (n, P_LEARNER) and b["responses"].shape == (n, R_LEARNER)
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], dim=1))
    assert ((b["responses"] >= 0) & (b["responses"] < len(dst_tok))).all()
    assert torch.equal(b[K.REWARD], rewards)  # the reward travels with the row
    # the text the reward saw is the faithful decode of the source's tokens ...
    assert outcome.texts == decode_responses(src_batch, src_tok)
    finished = list(out.non_tensor_batch[K.FINISHED])
    r_att = b["attention_mask"][:, P_LEARNER:].bool()
    for i in range(n):
        ids = b["responses"][i][r_att[i]].tolist()
        if finished[i]:
            assert ids[-1] == dst_tok.eos_token_id
            ids = ids[:-1]
        full = dst_tok.encode(outcome.texts[i], add_special_tokens=False, split_special_tokens=True)
        # ... and what the learner trains on is that text in its tokenization, cut at its limit
        assert ids == full[: len(ids)]
        if len(full) < R_LEARNER:
            assert ids == full
            assert dst_tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) == outcome.texts[i]


def _ids_strategy(tok):
    special = list(tok.all_special_ids)
    return st.lists(
        st.one_of(
            st.integers(0, len(tok) - 1),
            st.sampled_from(special),
            st.integers(len(tok), len(tok) + 1000),  # a head wider than the vocabulary
        ),
        max_size=80,
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), to_pair=st.booleans())
def test_property_arbitrary_ids_through_reward_and_exchange(verifier, char_tokenizer, pair_tokenizer, data, to_pair):
    src_tok, dst_tok = (char_tokenizer, pair_tokenizer) if to_pair else (pair_tokenizer, char_tokenizer)
    responses = data.draw(st.lists(_ids_strategy(src_tok), min_size=1, max_size=4))
    batch = source_batch(src_tok, responses)
    start = time.perf_counter()
    outcome, out = through_the_step(verifier, src_tok, dst_tok, batch)
    assert time.perf_counter() - start < 30
    check(outcome, out, batch, src_tok, dst_tok)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(texts=st.lists(hostile_text, min_size=1, max_size=4), to_pair=st.booleans(), finish=st.booleans())
def test_property_hostile_text_through_reward_and_exchange(verifier, char_tokenizer, pair_tokenizer, texts, to_pair, finish):
    src_tok, dst_tok = (char_tokenizer, pair_tokenizer) if to_pair else (pair_tokenizer, char_tokenizer)
    # split_special_tokens: a model spelling "<|im_end|>" produced characters, not the control token
    responses = [src_tok.encode(t, add_special_tokens=False, split_special_tokens=True) for t in texts]
    if finish:
        responses = [r + [src_tok.eos_token_id] for r in responses]
    batch = source_batch(src_tok, responses)
    outcome, out = through_the_step(verifier, src_tok, dst_tok, batch)
    check(outcome, out, batch, src_tok, dst_tok)


@pytest.mark.parametrize("to_pair", [True, False])
def test_listed_hostile_responses_and_a_correct_answer(verifier, char_tokenizer, pair_tokenizer, to_pair):
    src_tok, dst_tok = (char_tokenizer, pair_tokenizer) if to_pair else (pair_tokenizer, char_tokenizer)
    responses = [src_tok.encode(t, add_special_tokens=False, split_special_tokens=True) for t in HOSTILE_TEXTS]
    responses.append([src_tok.eos_token_id])  # finished at once: empty text
    batch = source_batch(src_tok, responses)
    outcome, out = through_the_step(verifier, src_tok, dst_tok, batch)
    check(outcome, out, batch, src_tok, dst_tok)
    assert outcome.rewards[2] == 1.0  # "\boxed{7}" is still right after everything else
    assert list(out.non_tensor_batch[K.FINISHED])[-1] is True


@pytest.mark.parametrize("to_pair", [True, False])
def test_huge_responses_are_bounded(verifier, char_tokenizer, pair_tokenizer, to_pair):
    src_tok, dst_tok = (char_tokenizer, pair_tokenizer) if to_pair else (pair_tokenizer, char_tokenizer)
    gen = torch.Generator().manual_seed(1)
    huge = [
        torch.randint(0, len(src_tok), (30000,), generator=gen).tolist(),
        src_tok.encode("\\boxed{" * 3000 + "7" + "}" * 3000, add_special_tokens=False),
        src_tok.encode("9" * 25000, add_special_tokens=False),
        [src_tok.eos_token_id] * 20000,
    ]
    batch = source_batch(src_tok, huge)
    start = time.perf_counter()
    outcome, out = through_the_step(verifier, src_tok, dst_tok, batch)
    assert time.perf_counter() - start < 60
    check(outcome, out, batch, src_tok, dst_tok)
    assert not any(out.non_tensor_batch[K.FINISHED][:3])

