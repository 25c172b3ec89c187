"""Rollout exchange between agents with different (and equal) tokenizers.

Source batches are laid out with verl's own agent-loop padding code, so the learner-side
layout is checked against verl's format rather than against the code under test.
"""

from __future__ import annotations

import time
import types
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from verl import DataProto
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.utils.model import compute_position_id_with_mask
from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

from recipe_hacpo import batch_keys, tiny_agents
from recipe_hacpo.exchange.retokenize import (
    LAYOUT_KEYS,
    RowConverter,
    attach_response_text,
    attach_source_log_prob_mean,
    decode_responses,
    exchange_batch,
    mean_log_prob_per_response,
    tokenizers_match,
)
from helpers.exchange import P_SRC, R_SRC, messages as _messages, valid_prompt_ids as _valid_prompt_ids, valid_response_ids as _valid_response_ids, assert_layout, make_source_batch


QUESTIONS = ["What is 0123+0456?", "Solve x^2 = 4.", "Compute \\frac{12}{3}."]
ANSWERS = ["0123+0456 = 579, so \\boxed{579}", "x = 2 or x = -2", "It is 4."]


@pytest.fixture(scope="module")
def char_to_pair(char_tokenizer, pair_tokenizer):
    return RowConverter(char_tokenizer, pair_tokenizer, max_prompt_length=128, max_response_length=48)


@pytest.fixture(scope="module")
def pair_to_char(char_tokenizer, pair_tokenizer):
    return RowConverter(pair_tokenizer, char_tokenizer, max_prompt_length=128, max_response_length=48)


# ----------------------------------------------------------------------------------------
# cross-tokenizer path
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("direction", ["char_to_pair", "pair_to_char"])
def test_text_round_trip_and_layout(request, direction, char_tokenizer, pair_tokenizer):
    exchange = request.getfixturevalue(direction)
    src_tok, dst_tok = exchange.source_tokenizer, exchange.learner_tokenizer
    src = make_source_batch(src_tok, QUESTIONS, ANSWERS, model_type="qwen2" if src_tok is char_tokenizer else "llama")
    out = exchange(src)

    assert not exchange.shared
    assert len(out) == len(src)
    assert_layout(out, dst_tok.pad_token_id, 128, 48)
    for i in range(len(src)):
        src_text = src_tok.decode(src.batch["responses"][i][src.batch["response_mask"][i].bool()].tolist(), skip_special_tokens=True)
        dst_text = dst_tok.decode(_valid_response_ids(out, i), skip_special_tokens=True)
        assert src_text == dst_text == ANSWERS[i]
        # single-turn: the whole learner response is trainable
        assert out.batch["response_mask"][i].sum().item() == len(_valid_response_ids(out, i))


def test_segmentation_really_changes(char_tokenizer, pair_tokenizer, char_to_pair):
    out = char_to_pair(make_source_batch(char_tokenizer, QUESTIONS[:1], ["0123"]))
    assert pair_tokenizer.convert_ids_to_tokens(_valid_response_ids(out, 0)) == ["01", "23", pair_tokenizer.eos_token]


def test_prompt_rendered_with_learner_template(char_tokenizer, pair_tokenizer, char_to_pair):
    src = make_source_batch(char_tokenizer, QUESTIONS, ANSWERS)
    out = char_to_pair(src)
    learner_builder = create_continuous_token_builder(pair_tokenizer, hf_model_type="llama")
    for i, question in enumerate(QUESTIONS):
        expected = learner_builder.build_initial_tokens(_messages(question))
        assert _valid_prompt_ids(out, i) == expected
        text = pair_tokenizer.decode(_valid_prompt_ids(out, i))
        assert text.startswith(pair_tokenizer.bos_token) and "<|im_start|>" not in text
        assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_eos_appended_only_when_finished(char_tokenizer, pair_tokenizer, char_to_pair):
    unfinished = char_tokenizer.encode("x = 2 or", add_special_tokens=False)
    src = make_source_batch(char_tokenizer, QUESTIONS, [ANSWERS[0], unfinished, ANSWERS[2]])
    out = char_to_pair(src)
    assert list(out.non_tensor_batch[batch_keys.FINISHED]) == [True, False, True]
    eos = pair_tokenizer.eos_token_id
    for i, finished in enumerate([True, False, True]):
        ids = _valid_response_ids(out, i)
        assert (ids[-1] == eos) is finished
        assert eos not in ids[:-1]


def test_stop_flag_from_batch_wins(char_tokenizer, pair_tokenizer, char_to_pair):
    """A rollout that stopped on a stop string (no EOS token) can say so through FINISHED."""
    ids = char_tokenizer.encode("done", add_special_tokens=False)
    src = make_source_batch(char_tokenizer, QUESTIONS[:1], [ids])
    src.non_tensor_batch[batch_keys.FINISHED] = np.array([True], dtype=object)
    out = char_to_pair(src)
    assert _valid_response_ids(out, 0)[-1] == pair_tokenizer.eos_token_id


def test_response_truncated_to_learner_limit(char_tokenizer, pair_tokenizer):
    long_answer = "The sum 0123+0456 equals 579 and the product is big."
    src = make_source_batch(char_tokenizer, QUESTIONS[:2], [long_answer, "ok"], response_width=80)
    ex = RowConverter(char_tokenizer, pair_tokenizer, max_prompt_length=128, max_response_length=12)
    out = ex(src)
    assert_layout(out, pair_tokenizer.pad_token_id, 128, 12)
    full = pair_tokenizer.encode(long_answer, add_special_tokens=False)
    assert _valid_response_ids(out, 0) == full[:12]
    assert list(out.non_tensor_batch[batch_keys.FINISHED]) == [False, True]

    # content fits exactly but the EOS does not: cut, so unfinished
    exact = RowConverter(char_tokenizer, pair_tokenizer, max_prompt_length=128, max_response_length=2)
    out = exact(make_source_batch(char_tokenizer, QUESTIONS[:1], ["0123"]))
    assert pair_tokenizer.convert_ids_to_tokens(_valid_response_ids(out, 0)) == ["01", "23"]
    assert list(out.non_tensor_batch[batch_keys.FINISHED]) == [False]


def test_prompt_overflow_left_truncates_or_raises(char_tokenizer, pair_tokenizer):
    src = make_source_batch(char_tokenizer, QUESTIONS, ANSWERS)
    full = create_continuous_token_builder(pair_tokenizer, hf_model_type="llama").build_initial_tokens(
        _messages(QUESTIONS[0])
    )
    left = RowConverter(char_tokenizer, pair_tokenizer, max_prompt_length=10, max_response_length=48)
    out = left(src)
    assert_layout(out, pair_tokenizer.pad_token_id, 10, 48)
    assert _valid_prompt_ids(out, 0) == full[-10:]
    strict = RowConverter(
        char_tokenizer, pair_tokenizer, max_prompt_length=10, max_response_length=48, prompt_overflow="error"
    )
    with pytest.raises(ValueError, match="max_prompt_length"):
        strict(src)
    with pytest.raises(ValueError):
        RowConverter(char_tokenizer, pair_tokenizer, max_prompt_length=10, max_response_length=8, prompt_overflow="x")


def test_fields_preserved_row_aligned(char_tokenizer, char_to_pair):
    src = make_source_batch(char_tokenizer, QUESTIONS, ANSWERS)
    out = char_to_pair(src)
    for key, value in src.non_tensor_batch.items():
        assert list(out.non_tensor_batch[key]) == list(value)
    for key in (batch_keys.SOURCE, batch_keys.REWARD, batch_keys.SOURCE_LOG_PROB_MEAN):
        assert torch.equal(out.batch[key], src.batch[key])
    assert "old_log_probs" not in out.batch.keys()  # source token positions: meaningless here
    assert out.meta_info == src.meta_info

    # the output concatenates with a learner-side batch of the same widths
    both = DataProto.concat([out, char_to_pair(src)])
    assert len(both) == 2 * len(src)


def test_attached_text_is_reused(char_tokenizer, pair_tokenizer, char_to_pair):
    src = make_source_batch(char_tokenizer, QUESTIONS, ANSWERS)
    attach_response_text(src, char_tokenizer)
    assert list(src.non_tensor_batch[batch_keys.RESPONSE_TEXT]) == ANSWERS
    with mock.patch.object(char_tokenizer, "batch_decode", side_effect=AssertionError("decoded twice")):
        out = char_to_pair(src)
    assert pair_tokenizer.decode(_valid_response_ids(out, 1), skip_special_tokens=True) == ANSWERS[1]


def test_requires_raw_prompt(char_tokenizer, char_to_pair):
    src = make_source_batch(char_tokenizer, QUESTIONS, ANSWERS)
    del src.non_tensor_batch["raw_prompt"]
    with pytest.raises(KeyError, match="raw_prompt"):
        char_to_pair(src)


# ----------------------------------------------------------------------------------------
# shared tokenizer: no text at all
# ----------------------------------------------------------------------------------------


def test_tokenizers_match(tiny_agent_paths, char_tokenizer, pair_tokenizer):
    from transformers import AutoTokenizer

    small = AutoTokenizer.from_pretrained(tiny_agent_paths["qwen2-char-small"])
    medium = AutoTokenizer.from_pretrained(tiny_agent_paths["qwen2-char-medium"])
    llama = AutoTokenizer.from_pretrained(tiny_agent_paths["llama-pair-medium"])
    assert tokenizers_match(small, medium) and tokenizers_match(small, char_tokenizer)
    assert tokenizers_match(llama, pair_tokenizer)
    assert not tokenizers_match(small, llama) and not tokenizers_match(char_tokenizer, pair_tokenizer)
    other_template = tiny_agents.build_char_tokenizer()
    other_template.chat_template = tiny_agents.PAIR_CHAT_TEMPLATE
    assert not tokenizers_match(char_tokenizer, other_template)


def _spy_text_calls(tok):
    """Patch every text entry point of `tok` so any use fails the test."""
    boom = AssertionError("text path used for a shared tokenizer")
    names = ("decode", "batch_decode", "encode", "__call__", "apply_chat_template")
    return [mock.patch.object(tok, n, side_effect=boom) for n in names if n != "__call__"] + [
        mock.patch.object(type(tok), "__call__", side_effect=boom)
    ]


def test_shared_tokenizer_is_identity(char_tokenizer):
    twin = tiny_agents.build_char_tokenizer()  # a different object with the same content
    src = make_source_batch(char_tokenizer, QUESTIONS, [ANSWERS[0], [5, 6, 7], ANSWERS[2]])
    ex = RowConverter(char_tokenizer, twin, max_prompt_length=P_SRC, max_response_length=R_SRC)
    assert ex.shared
    patches = _spy_text_calls(char_tokenizer) + _spy_text_calls(twin)
    for p in patches:
        p.start()
    try:
        out = ex(src)
        # different learner widths: re-padded, still without any text
        narrow = RowConverter(char_tokenizer, twin, max_prompt_length=128, max_response_length=9)(src)
    finally:
        for p in reversed(patches):
            p.stop()
    for key in LAYOUT_KEYS:
        assert torch.equal(out.batch[key], src.batch[key])
    assert list(out.non_tensor_batch[batch_keys.FINISHED]) == [True, False, True]

    assert_layout(narrow, twin.pad_token_id, 128, 9)
    for i in range(len(src)):
        assert _valid_response_ids(narrow, i) == _valid_response_ids(src, i)[:9]
        assert _valid_prompt_ids(narrow, i) == _valid_prompt_ids(src, i)
    assert list(narrow.non_tensor_batch[batch_keys.FINISHED]) == [False, False, True]


def test_declared_unshared_same_tokenizer_reproduces_tokens(char_tokenizer):
    """Forcing the text path on one tokenizer must land on the very same tensors."""
    src = make_source_batch(char_tokenizer, QUESTIONS, ANSWERS)
    out = exchange_batch(
        src, char_tokenizer, char_tokenizer, max_prompt_length=P_SRC, max_response_length=R_SRC, shared_tokenizer=False
    )
    for key in LAYOUT_KEYS:
        assert torch.equal(out.batch[key], src.batch[key]), key


# ----------------------------------------------------------------------------------------
# source mean log-prob
# ----------------------------------------------------------------------------------------


def test_mean_log_prob_per_response():
    log_probs = torch.tensor([[-1.0, -3.0, float("-inf")], [-0.5, -0.5, -0.5], [float("nan"), -2.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    mean = mean_log_prob_per_response(log_probs, mask)
    assert mean.dtype == torch.float32
    assert torch.allclose(mean, torch.tensor([-2.0, -0.5, 0.0]))


def test_attach_source_log_prob_mean(char_tokenizer):
    src = make_source_batch(char_tokenizer, QUESTIONS, ANSWERS)
    attach_source_log_prob_mean(src)
    lp, m = src.batch["old_log_probs"], src.batch["response_mask"].float()
    expected = (lp * m).sum(-1) / m.sum(-1)
    assert torch.allclose(src.batch[batch_keys.SOURCE_LOG_PROB_MEAN], expected)


# ----------------------------------------------------------------------------------------
# hostile responses
# ----------------------------------------------------------------------------------------


def test_hostile_responses_do_not_crash(char_tokenizer, pair_tokenizer):
    eos, pad, bos = char_tokenizer.eos_token_id, char_tokenizer.pad_token_id, char_tokenizer.bos_token_id
    a = char_tokenizer.encode("a", add_special_tokens=False)[0]
    weird = "\u202eRTL \u0000 NUL e\u0301 🙂 \ufeff 中文 <|eot_id|> <|im_end|>"
    responses = [
        [],  # empty, unfinished
        [eos],  # finished immediately
        [bos, a, pad, a, eos],  # special tokens inside
        [a, 10**6, -5, a],  # ids outside the vocabulary
        weird,  # odd unicode and special-token strings as text
        char_tokenizer.encode("🙂", add_special_tokens=False)[:2],  # cut inside a UTF-8 character
    ]
    src = make_source_batch(char_tokenizer, QUESTIONS[:1] * len(responses), responses, response_width=120)
    out = RowConverter(char_tokenizer, pair_tokenizer, max_prompt_length=128, max_response_length=200)(src)
    assert_layout(out, pair_tokenizer.pad_token_id, 128, 200)
    texts = [pair_tokenizer.decode(_valid_response_ids(out, i), skip_special_tokens=True) for i in range(len(responses))]
    assert texts[:4] == ["", "", "aa", "aa"]
    assert texts[4] == decode_responses(src, char_tokenizer)[4]
    assert list(out.non_tensor_batch[batch_keys.FINISHED]) == [False, True, True, False, True, False]
    assert _valid_response_ids(out, 0) == [] and _valid_response_ids(out, 1) == [pair_tokenizer.eos_token_id]
    # spelled-out special tokens are content for the learner, never its control tokens
    assert pair_tokenizer.eos_token_id not in _valid_response_ids(out, 4)[:-1]


def test_huge_response_is_bounded(char_tokenizer, pair_tokenizer):
    gen = torch.Generator().manual_seed(0)
    big = torch.randint(0, len(char_tokenizer), (4, 20000), generator=gen).tolist()
    src = make_source_batch(char_tokenizer, QUESTIONS[:1] * 4, big, response_width=20000)
    ex = RowConverter(char_tokenizer, pair_tokenizer, max_prompt_length=128, max_response_length=256)
    start = time.perf_counter()
    out = ex(src)
    assert time.perf_counter() - start < 10.0
    assert_layout(out, pair_tokenizer.pad_token_id, 128, 256)
    assert not any(out.non_tensor_batch[batch_keys.FINISHED])


# ----------------------------------------------------------------------------------------
# property: any text survives the trip
# ----------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    texts=st.lists(st.text(max_size=40), min_size=1, max_size=4),
    finished=st.lists(st.booleans(), min_size=4, max_size=4),
    to_pair=st.booleans(),
)
def test_property_text_survives(char_to_pair, pair_to_char, char_tokenizer, texts, finished, to_pair):
    ex = char_to_pair if to_pair else pair_to_char
    src_tok, dst_tok = ex.source_tokenizer, ex.learner_tokenizer
    responses = []
    for text, fin in zip(texts, finished):
        # split_special_tokens: a spelled-out special token in random text stays text
        ids = src_tok.encode(text, add_special_tokens=False, split_special_tokens=True)
        responses.append(ids + [src_tok.eos_token_id] if fin else ids)
    src = make_source_batch(
        src_tok,
        QUESTIONS[:1] * len(texts),
        responses,
        response_width=200,
        model_type="qwen2" if src_tok is char_tokenizer else "llama",
    )
    wide = RowConverter(src_tok, dst_tok, max_prompt_length=128, max_response_length=400)
    out = wide(src)
    assert_layout(out, dst_tok.pad_token_id, 128, 400)
    source_texts = decode_responses(src, src_tok)
    for i in range(len(texts)):
        ids = _valid_response_ids(out, i)
        assert dst_tok.decode(ids, skip_special_tokens=True) == source_texts[i]
        assert (len(ids) > 0 and ids[-1] == dst_tok.eos_token_id) is finished[i]


@pytest.mark.parametrize("shared", [False, True])
def test_empty_batch(char_tokenizer, pair_tokenizer, shared):
    def zeros(width):
        return torch.zeros(0, width, dtype=torch.int64)

    tensors = {key: zeros(7) for key in ("input_ids", "attention_mask", "position_ids")}
    tensors.update(prompts=zeros(4), responses=zeros(3), response_mask=zeros(3))
    src = DataProto(
        batch=TensorDict(tensors, batch_size=[0]), non_tensor_batch={"raw_prompt": np.empty(0, dtype=object)}
    )
    learner = char_tokenizer if shared else pair_tokenizer
    out = exchange_batch(src, char_tokenizer, learner, max_prompt_length=5, max_response_length=6)
    assert len(out) == 0 and out.batch["prompts"].shape == (0, 5) and out.batch["responses"].shape == (0, 6)
