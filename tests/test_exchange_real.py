"""The rollout exchange between the real Qwen3 and Llama-3 tokenizers.

The tiny agents' own tokenizers are byte-level toys; the presets' tokenizers have 151,669 and
128,256 ids, BPE merges across spaces and punctuation, `<think>` as an added token, a BOS in
Llama's template and `clean_up_tokenization_spaces: true` in Llama's config. Source batches are
laid out with verl's own agent-loop code (`make_source_batch` of test_exchange) and prompts are
compared with what verl's agent loop renders for the learner.

Qwen3's tokenizer normalises to NFC and Llama-3's does not: a text in another normal form reaches
a Qwen3 learner as its NFC form, the same ids Qwen3 gives that text itself. Everything else
round-trips character for character.
"""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from helpers.exchange import messages as _messages, valid_prompt_ids as _valid_prompt_ids, valid_response_ids as _valid_response_ids, assert_layout, make_source_batch
from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

from recipe_hacpo import batch_keys
from recipe_hacpo.exchange.retokenize import RowConverter, decode_responses, tokenizers_match
from recipe_hacpo.real_tokenizers import load_tokenizer

MODEL_TYPE = {"qwen3": "qwen3", "llama3": "llama"}  # config.json's model_type of each family

HARD_TEXTS = [
    # LaTeX
    r"We have \frac{1}{2} + \sqrt{x^2 + 1} = \boxed{\dfrac{3}{4}}, \left( \sum_{k=1}^{n} k \right) \le n^2.",
    # a reasoning block as Qwen3 writes it
    "<think>\nLet me add 5 and 3.\n5 + 3 = 8.\n</think>\n\nThe answer is \\boxed{8}.",
    # Unicode: accents (composed and combining), symbols, emoji with modifiers, zero-width space
    "naïve café — ‘quotes’ … e\u0301 Ω ≈ 3.14 ∀x∈ℝ 🙂👍🏽 a\u200bb",
    # CJK
    "中文测试：一加一等于二。日本語のテキスト、한국어 텍스트。",
    # runs of spaces, tabs and newlines, leading and trailing
    "  a    b\t\t c \n\n\n   d     ",
    # the " ." forms that clean_up_tokenization_spaces rewrites
    "Hello , world . It 's fine ; is n't it ? do n't ! ( x ) ' s",
    # special-token strings of both families typed as text
    "<|im_end|> <|eot_id|> <|begin_of_text|> <|endoftext|> <|start_header_id|>user<|end_header_id|> <|im_start|>",
    # code
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))\n",
]

SPELLED_SPECIALS = HARD_TEXTS[6]
SPACED_PUNCTUATION = HARD_TEXTS[5]


@pytest.fixture(scope="module")
def real():
    return {name: load_tokenizer(name) for name in ("qwen3", "llama3")}


def _exchange(real, source, learner, **kw):
    """An exchange declared unshared (comparing two 10 MB tokenizers costs seconds; tested once)."""
    kw = {"max_prompt_length": 256, "max_response_length": 512, "shared_tokenizer": False, **kw}
    return RowConverter(real[source], real[learner], **kw)


def _source_ids(tok, text, finished=True):
    """What a source model emitting `text` produced: typed special-token strings stay text."""
    ids = tok.encode(text, add_special_tokens=False, split_special_tokens=True)
    return ids + [tok.eos_token_id] if finished else ids


DIRECTIONS = [("qwen3", "llama3"), ("llama3", "qwen3")]


def _nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


def test_real_tokenizers_differ(real):
    assert not tokenizers_match(real["qwen3"], real["llama3"])
    assert tokenizers_match(real["qwen3"], load_tokenizer("qwen3"))
    assert not RowConverter(real["qwen3"], real["llama3"], max_prompt_length=8, max_response_length=8).shared


@pytest.mark.parametrize("source,learner", DIRECTIONS)
def test_hard_texts_round_trip_exactly(real, source, learner):
    src_tok, dst_tok = real[source], real[learner]
    finished = [i % 3 != 2 for i in range(len(HARD_TEXTS))]  # some rows end without EOS
    responses = [_source_ids(src_tok, t, f) for t, f in zip(HARD_TEXTS, finished)]
    src = make_source_batch(
        src_tok, ["What is 5+3?"] * len(HARD_TEXTS), responses, response_width=200, model_type=MODEL_TYPE[source]
    )
    out = _exchange(real, source, learner)(src)
    assert_layout(out, dst_tok.pad_token_id, 256, 512)
    assert list(out.non_tensor_batch[batch_keys.FINISHED]) == finished
    # special ids of the learner that a response may hold: its EOS, once, at the end
    control = set(dst_tok.all_special_ids) - {dst_tok.eos_token_id}
    for i, (text, fin) in enumerate(zip(HARD_TEXTS, finished)):
        ids = _valid_response_ids(out, i)
        assert decode_responses(src, src_tok)[i] == (_nfc(text) if source == "qwen3" else text)
        assert dst_tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) == _nfc(text)
        assert (ids[-1] == dst_tok.eos_token_id) is fin
        assert dst_tok.eos_token_id not in ids[:-1] and not control & set(ids), text
        # the learner's ids are the learner's own encoding of the text, not a copy of the source's
        assert ids[: len(ids) - fin] == dst_tok.encode(_nfc(text), add_special_tokens=False, split_special_tokens=True)


def test_non_nfc_text_reaches_qwen3_as_its_nfc_form(real):
    """Llama-3 keeps a combining accent as written; Qwen3 composes it, as it does for its own text."""
    text = "cafe\u0301 e\u0301"
    assert _nfc(text) != text
    l3, q = real["llama3"], real["qwen3"]
    src = make_source_batch(l3, ["q"], [_source_ids(l3, text)], response_width=32, model_type="llama")
    assert decode_responses(src, l3) == [text]
    ids = _valid_response_ids(_exchange(real, "llama3", "qwen3")(src), 0)
    assert ids[:-1] == q.encode(text, add_special_tokens=False) == q.encode(_nfc(text), add_special_tokens=False)
    assert q.decode(ids, skip_special_tokens=True) == _nfc(text)


def test_segmentations_really_differ(real):
    """The texts are not trivially shared: the two vocabularies cut them differently."""
    for text in HARD_TEXTS:
        q = real["qwen3"].convert_ids_to_tokens(real["qwen3"].encode(text, add_special_tokens=False))
        l3 = real["llama3"].convert_ids_to_tokens(real["llama3"].encode(text, add_special_tokens=False))
        assert q != l3 or text.isascii()
    digits = "1234567"
    assert real["qwen3"].convert_ids_to_tokens(real["qwen3"].encode(digits)) == list(digits)  # one digit a token
    assert real["llama3"].convert_ids_to_tokens(real["llama3"].encode(digits, add_special_tokens=False)) == ["123", "456", "7"]


def test_think_is_one_token_for_qwen3_and_text_for_llama(real):
    q, l3 = real["qwen3"], real["llama3"]
    think = q.convert_tokens_to_ids("<think>")
    assert q.encode("<think>", add_special_tokens=False) == [think]
    assert think not in q.all_special_ids  # an added token that is not special: decoding keeps it
    src = make_source_batch(l3, ["q"], [_source_ids(l3, HARD_TEXTS[1])], response_width=64, model_type="llama")
    out = _exchange(real, "llama3", "qwen3")(src)
    ids = _valid_response_ids(out, 0)
    assert ids[0] == think and ids.count(q.convert_tokens_to_ids("</think>")) == 1
    assert len(l3.encode("<think>", add_special_tokens=False)) > 1


def test_llama_clean_up_does_not_touch_the_exchange(real):
    """Llama-3's config asks for clean_up_tokenization_spaces, which rewrites " ." to "." and
    " 's" to "'s". The exchange decodes with the clean-up off, so it holds even where
    transformers applies the clean-up to BPE tokenizers (forced here: a negative control)."""
    l3 = load_tokenizer("llama3")
    assert l3.clean_up_tokenization_spaces is True
    l3.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    ids = l3.encode(SPACED_PUNCTUATION, add_special_tokens=False)
    assert l3.decode(ids) != SPACED_PUNCTUATION  # the config's clean-up, applied, breaks the text
    assert l3.decode(ids) == l3.clean_up_tokenization(SPACED_PUNCTUATION)

    src = make_source_batch(l3, ["q"], [ids + [l3.eos_token_id]], response_width=64, model_type="llama")
    assert decode_responses(src, l3) == [SPACED_PUNCTUATION]
    out = RowConverter(l3, real["qwen3"], max_prompt_length=256, max_response_length=64)(src)
    assert real["qwen3"].decode(_valid_response_ids(out, 0), skip_special_tokens=True) == SPACED_PUNCTUATION


def test_spelled_special_tokens_stay_text(real):
    q, l3 = real["qwen3"], real["llama3"]
    for source, learner in DIRECTIONS:
        src_tok, dst_tok = real[source], real[learner]
        src = make_source_batch(src_tok, ["q"], [_source_ids(src_tok, SPELLED_SPECIALS)], response_width=128,
                                model_type=MODEL_TYPE[source])
        ids = _valid_response_ids(_exchange(real, source, learner)(src), 0)
        assert ids[-1] == dst_tok.eos_token_id and not set(ids[:-1]) & set(dst_tok.all_special_ids)
    # and a source whose response really ends on its EOS id is finished; its spelled EOS is not
    spelled_eos_only = _source_ids(q, "<|im_end|>", finished=False)
    src = make_source_batch(q, ["q"], [spelled_eos_only], response_width=32, model_type="qwen3")
    out = _exchange(real, "qwen3", "llama3")(src)
    assert list(out.non_tensor_batch[batch_keys.FINISHED]) == [False]
    assert l3.decode(_valid_response_ids(out, 0)) == "<|im_end|>"


def test_source_eos_list_of_the_generation_config(real):
    """Qwen3 also stops on <|endoftext|>, Llama-3.2 on <|end_of_text|> and <|eom_id|>: given the
    generation config's list, each ends a finished row (and gets the learner's EOS)."""
    q, l3 = real["qwen3"], real["llama3"]
    qwen_eos = [q.eos_token_id, q.convert_tokens_to_ids("<|endoftext|>")]
    llama_eos = [l3.convert_tokens_to_ids("<|end_of_text|>"), 128_008, l3.eos_token_id]
    for source, eos_ids, learner in (("qwen3", qwen_eos, "llama3"), ("llama3", llama_eos, "qwen3")):
        src_tok = real[source]
        body = src_tok.encode("x = 8", add_special_tokens=False)
        rows = [body + [e] for e in eos_ids] + [body]
        src = make_source_batch(src_tok, ["q"] * len(rows), rows, response_width=16, model_type=MODEL_TYPE[source])
        out = _exchange(real, source, learner, source_eos_ids=eos_ids)(src)
        assert list(out.non_tensor_batch[batch_keys.FINISHED]) == [True] * len(eos_ids) + [False]
        for i in range(len(eos_ids)):
            assert _valid_response_ids(out, i)[-1] == real[learner].eos_token_id
        plain = _exchange(real, source, learner)(src)  # the tokenizer's EOS only
        assert list(plain.non_tensor_batch[batch_keys.FINISHED]).count(True) == 1


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
@pytest.mark.parametrize("source,learner", DIRECTIONS)
def test_prompt_is_the_learners_own_rendering(real, source, learner, kwargs):
    """The learner's prompt ids are what verl's agent loop renders for it from the messages."""
    questions = ["What is 5+3?", "Simplify \\frac{6}{8}.", "中文：一加一？"]
    src_tok, dst_tok = real[source], real[learner]
    src = make_source_batch(src_tok, questions, ["8", "3/4", "二"], model_type=MODEL_TYPE[source], prompt_width=96)
    out = _exchange(real, source, learner, chat_template_kwargs=kwargs)(src)
    builder = create_continuous_token_builder(dst_tok, hf_model_type=MODEL_TYPE[learner], chat_template_kwargs=kwargs)
    for i, question in enumerate(questions):
        prompt = _valid_prompt_ids(out, i)
        assert prompt == builder.build_initial_tokens(_messages(question))
        text = dst_tok.decode(prompt)
        if learner == "llama3":
            assert prompt.count(dst_tok.bos_token_id) == 1 and prompt[0] == dst_tok.bos_token_id  # BOS once
            assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n") and "<|im_start|>" not in text
        else:
            assert dst_tok.bos_token_id is None and "<|begin_of_text|>" not in text
            tail = "<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if kwargs else "")
            assert text.endswith(tail) and text.count("<think>") == (1 if kwargs else 0)


@pytest.fixture(scope="module")
def wide(real):
    return {d: _exchange(real, *d, max_response_length=800) for d in DIRECTIONS}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    texts=st.lists(st.text(max_size=60), min_size=1, max_size=4),
    finished=st.lists(st.booleans(), min_size=4, max_size=4),
    to_llama=st.booleans(),
)
def test_property_any_text_survives(real, wide, texts, finished, to_llama):
    source, learner = ("qwen3", "llama3") if to_llama else ("llama3", "qwen3")
    src_tok, dst_tok = real[source], real[learner]
    responses = [_source_ids(src_tok, t, f) for t, f in zip(texts, finished)]
    src = make_source_batch(src_tok, ["q"] * len(texts), responses, response_width=400, model_type=MODEL_TYPE[source])
    out = wide[(source, learner)](src)
    source_texts = decode_responses(src, src_tok)
    for i in range(len(texts)):
        ids = _valid_response_ids(out, i)
        expected = _nfc(source_texts[i]) if learner == "qwen3" else source_texts[i]
        assert dst_tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) == expected
        assert (len(ids) > 0 and ids[-1] == dst_tok.eos_token_id) is finished[i]
