"""Rollout exchange: re-express a source agent's rollout batch in a learner's tokenization.

A rollout batch leaves verl's agent loop (`AgentLoopWorker._postprocess`, verl 0.9.1) as a
`DataProto` with, for B rows, prompt width P and response width R (the rollout's
`prompt_length` / `response_length`):

    prompts        int64 [B, P]      left-padded with the tokenizer's pad id
    responses      int64 [B, R]      right-padded with the pad id
    response_mask  int64 [B, R]      1 on model-generated tokens, 0 on tool tokens / padding
    input_ids      int64 [B, P + R]  prompts ++ responses
    attention_mask int64 [B, P + R]  1 on real tokens (prompt and response), 0 on padding
    position_ids   int64 [B, P + R]  clip(cumsum(attention_mask) - 1, min=0)
    non-tensor     raw_prompt (chat messages), uid, data_source, reward_model, ...

`exchange_batch` returns the same layout for the learner (widths = the learner's limits):

- shared tokenizer: no decoding and no encoding; token tensors are kept (re-padded only if
  the learner's widths differ);
- different tokenizers: the response (tokens with response_mask == 1, special tokens
  skipped) is decoded to text and encoded by the learner; the prompt is rendered from
  `raw_prompt` with the learner's own chat template, exactly as verl's agent loop renders
  it; the learner's EOS is appended when the source finished (its last response token is one
  of the source's EOS ids); responses longer than the learner's `max_response_length` are
  right-truncated and then count as unfinished; prompts longer than `max_prompt_length` are
  left-truncated (as verl's agent loop does) or rejected, see `prompt_overflow`.

Kept row-aligned: every non-tensor field and every per-row (1-D) tensor, e.g. the HACPO keys
of `batch_keys`. Per-token tensors other than the six layout keys (`old_log_probs`,
`rollout_log_probs`, `rm_scores`, ...) belong to the source's token positions and are
dropped in both paths, so the output key set never depends on the path; whatever is needed
from them must travel as a per-row value (`SOURCE_LOG_PROB_MEAN`, `REWARD`).
The output's `FINISHED` says whether the learner row ends on the learner's EOS.

Multi-modal rows (3-D position ids, `multi_modal_inputs`) are not supported.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np
import torch
from tensordict import TensorDict
from verl import DataProto
from verl.utils.tokenizer.chat_template import apply_chat_template, normalize_token_ids

from recipe_hacpo import batch_keys

LAYOUT_KEYS = ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids")
"""The token-layout tensors the exchange rebuilds for the learner."""

PROMPT_OVERFLOW_MODES = ("left", "error")

# ---------------------------------------------------------------------------------------
# per-response statistics that travel with the sample
# ---------------------------------------------------------------------------------------


def mean_log_prob_per_response(log_probs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Mean of `log_probs` over the masked tokens of each row.

    log_probs: float [B, R]; response_mask: {0,1} [B, R]. Returns float32 [B]; a row without
    any masked token gets 0.0 rather than NaN (it then carries no gradient anyway).
    """
    mask = response_mask.to(torch.float64)
    # Masked positions may hold anything (padding log-probs can be -inf); zero them, not multiply.
    values = torch.where(mask > 0, log_probs.to(torch.float64), torch.zeros((), dtype=torch.float64))
    total = values.sum(dim=-1)
    count = mask.sum(dim=-1)
    return (total / count.clamp(min=1.0)).to(torch.float32)


def attach_source_log_prob_mean(batch: DataProto, log_prob_key: str = "old_log_probs") -> DataProto:
    """Store `SOURCE_LOG_PROB_MEAN` [B] in `batch` (in place) from the source's own log-probs.

    Must run on the source side, before `exchange_batch`, since per-token log-probs do not
    survive re-tokenization.
    """
    batch.batch[batch_keys.SOURCE_LOG_PROB_MEAN] = mean_log_prob_per_response(
        batch.batch[log_prob_key], batch.batch["response_mask"]
    )
    return batch


# ---------------------------------------------------------------------------------------
# tokenizer identity
# ---------------------------------------------------------------------------------------


def _special_ids(tok: Any) -> tuple:
    return (
        tok.pad_token_id,
        tok.eos_token_id,
        tok.bos_token_id,
        tok.unk_token_id,
        tuple(sorted(tok.all_special_ids)),
    )


def tokenizers_match(a: Any, b: Any) -> bool:
    """True when `a` and `b` turn the same text and messages into the same token ids.

    Compares the full backend serialisation (normaliser, pre-tokeniser, model, added tokens)
    when both are fast tokenizers, otherwise the vocabularies; plus the chat template and the
    special-token ids. Different objects loaded from the same checkpoint therefore match.
    """
    if a is b:
        return True
    if len(a) != len(b) or _special_ids(a) != _special_ids(b):
        return False
    if getattr(a, "chat_template", None) != getattr(b, "chat_template", None):
        return False
    backend_a, backend_b = getattr(a, "backend_tokenizer", None), getattr(b, "backend_tokenizer", None)
    if backend_a is not None and backend_b is not None:
        return backend_a.to_str() == backend_b.to_str()
    return a.get_vocab() == b.get_vocab()


# ---------------------------------------------------------------------------------------
# reading the source layout
# ---------------------------------------------------------------------------------------


def eos_token_ids(model_dir: str, tokenizer: Any) -> list[int]:
    """Every id that ends a response of a model: its tokenizer's EOS and its generation config's."""
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = None
    ids.update([eos] if isinstance(eos, int) else (eos or []))
    return sorted(ids)


def _as_id_set(ids: int | Iterable[int] | None) -> set[int]:
    if ids is None:
        return set()
    if isinstance(ids, (int, np.integer)):
        return {int(ids)}
    return {int(i) for i in ids}


def response_valid_mask(batch: DataProto) -> torch.Tensor:
    """bool [B, R]: real (non-padding) response positions, from the response half of attention_mask."""
    prompt_width = batch.batch["prompts"].shape[1]
    return batch.batch["attention_mask"][:, prompt_width:].bool()


def response_finished(batch: DataProto, eos_ids: int | Iterable[int]) -> np.ndarray:
    """bool [B]: the row's last real response token is one of `eos_ids`.

    A response cut by the length limit ends on an ordinary token, an empty response on none.
    If the batch already carries `FINISHED` (e.g. the rollout knew about stop strings), that
    value wins.
    """
    if batch_keys.FINISHED in batch.non_tensor_batch:
        return np.asarray(batch.non_tensor_batch[batch_keys.FINISHED], dtype=bool)
    valid = response_valid_mask(batch)
    lengths = valid.sum(dim=-1)
    last = batch.batch["responses"].gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    eos = torch.tensor(sorted(_as_id_set(eos_ids)), dtype=last.dtype)
    return ((lengths > 0) & torch.isin(last, eos)).numpy()


def _rows(ids: torch.Tensor, keep: torch.Tensor) -> list[list[int]]:
    """Per-row lists of `ids` [B, W] where `keep` [B, W] is true, in order."""
    return [row[m].tolist() for row, m in zip(ids, keep)]


def decode_responses(batch: DataProto, tokenizer: Any) -> list[str]:
    """Text of each response: tokens with response_mask == 1 only, special tokens skipped.

    Ids outside the tokenizer's range (a model head can be wider than its vocabulary) are
    dropped instead of crashing the decoder. Returns B strings.
    """
    keep = response_valid_mask(batch)
    if "response_mask" in batch.batch.keys():
        keep = keep & batch.batch["response_mask"].bool()
    ids = batch.batch["responses"]
    keep = keep & (ids >= 0) & (ids < len(tokenizer))
    rows = _rows(ids, keep)
    if not rows:  # batch_decode([]) answers [""], not []
        return []
    return tokenizer.batch_decode(rows, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def attach_response_text(batch: DataProto, tokenizer: Any, eos_ids: int | Iterable[int] | None = None) -> DataProto:
    """Store `RESPONSE_TEXT` and `FINISHED` (object [B]) in `batch` in place.

    Decoding once per source batch lets every learner reuse the text: `exchange_batch`
    takes `RESPONSE_TEXT` from the batch when present instead of decoding again.
    """
    eos = _as_id_set(tokenizer.eos_token_id) | _as_id_set(eos_ids)
    finished = response_finished(batch, eos)
    batch.non_tensor_batch[batch_keys.RESPONSE_TEXT] = np.array(decode_responses(batch, tokenizer), dtype=object)
    batch.non_tensor_batch[batch_keys.FINISHED] = np.array(finished.tolist(), dtype=object)
    return batch


# ---------------------------------------------------------------------------------------
# writing the learner layout
# ---------------------------------------------------------------------------------------


def pack_rows(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    *,
    pad_id: int,
    prompt_width: int,
    response_width: int,
    response_masks: Sequence[Sequence[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """verl's rollout layout from per-row token lists (each already within its width).

    Returns the six `LAYOUT_KEYS`: prompts [B, P] left-padded, responses / response_mask
    [B, R] right-padded, input_ids / attention_mask / position_ids [B, P + R].
    `response_masks` defaults to all ones over each response.
    """
    bsz = len(prompt_ids)
    prompt_lengths = np.fromiter(map(len, prompt_ids), dtype=np.int64, count=bsz)
    response_lengths = np.fromiter(map(len, response_ids), dtype=np.int64, count=bsz)
    too_long = np.flatnonzero((prompt_lengths > prompt_width) | (response_lengths > response_width))
    if len(too_long):
        i = int(too_long[0])
        raise ValueError(f"row {i}: {len(prompt_ids[i])} prompt / {len(response_ids[i])} response tokens exceed the widths")
    # one vectorised fill per tensor instead of a Python loop over rows: this runs on the exchange's
    # background threads, where every line that holds the GIL slows the trainer's own thread
    prompt_keep = np.arange(prompt_width) >= (prompt_width - prompt_lengths)[:, None]  # left-padded
    response_keep = np.arange(response_width) < response_lengths[:, None]  # right-padded
    prompts = _filled(prompt_ids, prompt_keep, pad_id)
    responses = _filled(response_ids, response_keep, pad_id)
    prompt_att = torch.from_numpy(prompt_keep.astype(np.int64))
    response_att = torch.from_numpy(response_keep.astype(np.int64))
    if response_masks is None:
        response_mask = response_att.clone()
    else:
        mask_lengths = np.fromiter(map(len, response_masks), dtype=np.int64, count=bsz)
        if (mask_lengths != response_lengths).any():
            i = int(np.flatnonzero(mask_lengths != response_lengths)[0])
            raise ValueError(f"row {i}: a response mask of {mask_lengths[i]} for {response_lengths[i]} response tokens")
        response_mask = _filled(response_masks, response_keep, 0)
    attention_mask = torch.cat([prompt_att, response_att], dim=1)
    return {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask * response_att,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        # Same formula as verl.utils.model.compute_position_id_with_mask.
        "position_ids": torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0),
    }


def _filled(rows: Sequence[Sequence[int]], keep: np.ndarray, fill: int) -> torch.Tensor:
    """int64 [B, W]: `fill` everywhere, each row's values in order at its `keep` positions (row-major:
    `keep` holds exactly len(rows[i]) true entries in row i)."""
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(keep.sum()))
    out = np.full(keep.shape, fill, dtype=np.int64)
    out[keep] = flat
    return torch.from_numpy(out)


def _fit_prompt(ids: list[int], limit: int, mode: str, row: int) -> list[int]:
    if len(ids) <= limit:
        return ids
    if mode == "error":
        raise ValueError(f"row {row}: prompt of {len(ids)} tokens exceeds max_prompt_length={limit}")
    # Keep the end: the generation prompt ("assistant" header) is what the response follows.
    return ids[len(ids) - limit :]


# ---------------------------------------------------------------------------------------
# the exchange
# ---------------------------------------------------------------------------------------


class Prepared(NamedTuple):
    """One batch's learner-side token layout (the six `LAYOUT_KEYS`) and its FINISHED (bool [B]),
    before the per-row fields are attached (`RowConverter.finish`)."""

    layout: dict[str, torch.Tensor]
    finished: np.ndarray

    def select(self, rows: torch.Tensor | Sequence[int]) -> "Prepared":
        """The same rows as `DataProto.select_idxs(rows)` takes of the source batch."""
        index = torch.as_tensor(rows, dtype=torch.long)
        return Prepared({k: v[index] for k, v in self.layout.items()}, self.finished[index.numpy()])


class RowConverter:
    """Converts rollout batches of one source agent into one learner's tokenization.

    Build once per (source, learner) pair: tokenizer comparison and prompt rendering are
    cached here. Prompts are cached by their messages, since G responses share one prompt.
    """

    def __init__(
        self,
        source_tokenizer: Any,
        learner_tokenizer: Any,
        *,
        max_prompt_length: int,
        max_response_length: int,
        shared_tokenizer: bool | None = None,
        source_eos_ids: int | Iterable[int] | None = None,
        learner_eos_id: int | None = None,
        prompt_overflow: str = "left",
        chat_template_kwargs: dict | None = None,
    ):
        """
        max_prompt_length / max_response_length: the learner's rollout widths P / R.
        shared_tokenizer: declare (True/False) instead of detecting with `tokenizers_match`.
        source_eos_ids: ids that end a source response (default: its tokenizer's eos id; pass
            the generation_config's list when it has several).
        learner_eos_id: id appended to finished responses (default: learner's eos id).
        prompt_overflow: "left" keeps the last max_prompt_length tokens (verl's agent loop
            does the same), "error" raises ValueError.
        chat_template_kwargs: verl's `data.apply_chat_template_kwargs` of the learner.
        """
        if prompt_overflow not in PROMPT_OVERFLOW_MODES:
            raise ValueError(f"prompt_overflow must be one of {PROMPT_OVERFLOW_MODES}, got {prompt_overflow!r}")
        if max_prompt_length < 1 or max_response_length < 1:
            raise ValueError("max_prompt_length and max_response_length must be positive")
        self.source_tokenizer = source_tokenizer
        self.learner_tokenizer = learner_tokenizer
        self.max_prompt_length = int(max_prompt_length)
        self.max_response_length = int(max_response_length)
        self.prompt_overflow = prompt_overflow
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.shared = (
            tokenizers_match(source_tokenizer, learner_tokenizer) if shared_tokenizer is None else bool(shared_tokenizer)
        )
        self.source_eos_ids = _as_id_set(source_tokenizer.eos_token_id) | _as_id_set(source_eos_ids)
        self.learner_eos_id = learner_tokenizer.eos_token_id if learner_eos_id is None else int(learner_eos_id)
        if learner_tokenizer.pad_token_id is None:
            raise ValueError("the learner tokenizer needs a pad token")
        self.pad_id = int(learner_tokenizer.pad_token_id)
        self._prompt_cache: dict[str, list[int]] = {}

    # -- prompts ------------------------------------------------------------------------

    def render_prompt(self, messages: Any) -> list[int]:
        """Learner token ids of `messages` with its chat template and generation prompt.

        Goes through verl's own `apply_chat_template` helper so the ids equal those of the
        learner's own rollouts for the same prompt.
        """
        if isinstance(messages, np.ndarray):
            messages = messages.tolist()
        key = json.dumps(messages, sort_keys=True, default=str)
        cached = self._prompt_cache.get(key)
        if cached is None:
            rendered = apply_chat_template(
                self.learner_tokenizer,
                list(messages),
                tokenize=True,
                add_generation_prompt=True,
                **self.chat_template_kwargs,
            )
            cached = [int(t) for t in normalize_token_ids(rendered)]
            self._prompt_cache[key] = cached
        return list(cached)

    # -- responses ----------------------------------------------------------------------

    def encode_responses(self, texts: Sequence[str], finished: Sequence[bool]) -> tuple[list[list[int]], np.ndarray]:
        """Learner ids of each response text, EOS appended when finished, cut to R.

        Special-token strings inside the text (a character model can spell `<|eot_id|>`)
        are encoded as plain text: they are content, not control tokens for the learner.
        Returns (B id lists, bool [B] finished after truncation).
        """
        if not texts:
            return [], np.zeros(0, dtype=bool)
        encoded = self.learner_tokenizer(
            list(texts), add_special_tokens=False, split_special_tokens=True, return_attention_mask=False
        )["input_ids"]
        out, done = [], np.zeros(len(texts), dtype=bool)
        for i, (ids, fin) in enumerate(zip(encoded, finished)):
            ids = list(ids)
            if fin and self.learner_eos_id is not None:
                ids.append(self.learner_eos_id)
            done[i] = bool(fin) and self.learner_eos_id is not None
            if len(ids) > self.max_response_length:
                ids = ids[: self.max_response_length]
                done[i] = False
            out.append(ids)
        return out, done

    # -- batches ------------------------------------------------------------------------

    def __call__(self, batch: DataProto) -> DataProto:
        return self.convert(batch)

    def convert(self, batch: DataProto) -> DataProto:
        """The learner-side DataProto for `batch` (a source rollout batch); see module doc.

        Two halves, which `exchange/jobs.py::ConversionJobs` runs apart: `prepare` (the token work, from
        the token tensors and the text only) and `finish` (the per-row fields, whatever the batch
        carries by then). `convert(b)` is `finish(b, prepare(b))`.
        """
        return self.finish(batch, self.prepare(batch))

    def prepare(self, batch: DataProto, texts: Sequence[str] | None = None) -> "Prepared":
        """The learner's token layout and FINISHED of every row of `batch`.

        Reads only `prompts`, `responses`, `response_mask`, `attention_mask`, the source's
        `FINISHED` when set, `raw_prompt` and the response text: `texts` when given, else
        `RESPONSE_TEXT`, else decoded here. Every row is converted on its own, so preparing a
        whole batch and selecting rows (`Prepared.select`) equals preparing the selected rows.
        """
        finished = response_finished(batch, self.source_eos_ids)
        if self.shared:
            layout, done = self._relayout_shared(batch, finished)
        else:
            layout, done = self._retokenize(batch, finished, texts)
        return Prepared(layout, done)

    def finish(self, batch: DataProto, prepared: "Prepared") -> DataProto:
        """The learner-side DataProto: `prepared`'s layout, then every per-row (1-D) tensor and
        every non-tensor field `batch` holds now (row-aligned), FINISHED the learner's."""
        if len(prepared.finished) != len(batch):
            raise ValueError(f"{len(prepared.finished)} prepared rows for a batch of {len(batch)}")
        tensors = dict(prepared.layout)
        for key, value in batch.batch.items():
            # Per-row values travel; per-token ones are tied to source positions.
            if key not in LAYOUT_KEYS and isinstance(value, torch.Tensor) and value.dim() == 1:
                tensors[key] = value.clone()
        non_tensor = {key: np.array(value, copy=True) for key, value in batch.non_tensor_batch.items()}
        non_tensor[batch_keys.FINISHED] = np.array(prepared.finished.tolist(), dtype=object)
        return DataProto(
            batch=TensorDict(tensors, batch_size=[len(batch)]),
            non_tensor_batch=non_tensor,
            meta_info=dict(batch.meta_info),
        )

    def _relayout_shared(self, batch: DataProto, finished: np.ndarray) -> tuple[dict[str, torch.Tensor], np.ndarray]:
        """Same tokenizer: reuse the token tensors; re-pad only when the widths differ."""
        src = batch.batch
        prompt_width, response_width = src["prompts"].shape[1], src["responses"].shape[1]
        if (prompt_width, response_width) == (self.max_prompt_length, self.max_response_length):
            return {key: src[key].clone() for key in LAYOUT_KEYS}, finished.copy()

        prompt_keep = src["attention_mask"][:, :prompt_width].bool()
        response_keep = response_valid_mask(batch)
        prompts = [
            _fit_prompt(p, self.max_prompt_length, self.prompt_overflow, i)
            for i, p in enumerate(_rows(src["prompts"], prompt_keep))
        ]
        responses = _rows(src["responses"], response_keep)
        masks = _rows(src["response_mask"], response_keep)
        done = finished.copy()
        for i, r in enumerate(responses):
            if len(r) > self.max_response_length:
                responses[i], masks[i] = r[: self.max_response_length], masks[i][: self.max_response_length]
                done[i] = False
        return self._pack(prompts, responses, masks), done

    def _retokenize(
        self, batch: DataProto, finished: np.ndarray, texts: Sequence[str] | None = None
    ) -> tuple[dict[str, torch.Tensor], np.ndarray]:
        """Different tokenizers: text of the response, learner's template for the prompt."""
        if "raw_prompt" not in batch.non_tensor_batch:
            raise KeyError("re-tokenization needs the chat messages in non_tensor_batch['raw_prompt']")
        if texts is not None:
            if len(texts) != len(batch):
                raise ValueError(f"{len(texts)} response texts for a batch of {len(batch)}")
            texts = [str(t) for t in texts]
        elif batch_keys.RESPONSE_TEXT in batch.non_tensor_batch:
            texts = [str(t) for t in batch.non_tensor_batch[batch_keys.RESPONSE_TEXT]]
        else:
            texts = decode_responses(batch, self.source_tokenizer)
        prompts = [
            _fit_prompt(self.render_prompt(messages), self.max_prompt_length, self.prompt_overflow, i)
            for i, messages in enumerate(batch.non_tensor_batch["raw_prompt"])
        ]
        responses, done = self.encode_responses(texts, finished)
        return self._pack(prompts, responses), done

    def _pack(self, prompts, responses, masks=None) -> dict[str, torch.Tensor]:
        """The learner's rollout layout at its widths (`pack_rows`)."""
        return pack_rows(prompts, responses, pad_id=self.pad_id, prompt_width=self.max_prompt_length,
                         response_width=self.max_response_length, response_masks=masks)


def exchange_batch(
    batch: DataProto,
    source_tokenizer: Any,
    learner_tokenizer: Any,
    *,
    max_prompt_length: int,
    max_response_length: int,
    **kwargs: Any,
) -> DataProto:
    """One-shot `RowConverter(...).convert(batch)`; keyword arguments as for `RowConverter`."""
    exchange = RowConverter(
        source_tokenizer,
        learner_tokenizer,
        max_prompt_length=max_prompt_length,
        max_response_length=max_response_length,
        **kwargs,
    )
    return exchange.convert(batch)
