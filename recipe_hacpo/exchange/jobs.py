"""The exchange off the step's critical path: conversions start as each source's rollouts arrive.

Re-tokenizing a peer's rows (`RowConverter`) needs only the source's token tensors, its chat
messages and its response text; the per-row values the trainer adds later (reward, the source's
mean log-prob and response length, HACPO's tags) are 1-D and are attached afterwards by row.
So the token work of every (source, learner) pair can run while the trainer scores and computes
old log-probs:

    generate       as each agent's rollouts return, `start(source, rollouts)` submits
                   the decoding of its response text (the text scoring reads) and then
                   `RowConverter.prepare` for every learner, on background threads
    score          `texts(source)`: that decoded text, instead of decoding again
    old log-probs  (conversions run meanwhile)
    exchange       `convert(source, learner, rollouts[, rows])` waits for the pair (the wait is
                   `timing_s/exchange_wait`), then `RowConverter.finish` attaches every
                   per-row field the source batch holds at that moment, exactly as a serial
                   `convert` at that point would

The learner batches are the serial path's, bit for bit: `prepare` reads nothing the trainer
changes between generate and exchange, which `convert` checks (the tensors it read are still the
same objects with the same contents, the messages the same array); a change fails the step with
one line naming the source and the field. Preparing a whole source batch and taking rows
(GRAFT, SGT) equals preparing those rows, since every row is converted on its own.

Threads, not processes: the HF `tokenizers` batch calls run in Rust without the GIL
(benchmarks/exchange_scale.py measures it). A tokenizer object is never used by two threads at
once: its settings (`encode_special_tokens`, which the exchange sets for responses and the chat
template resets for prompts) are shared state, so every job holds the lock of the one tokenizer
it uses. Pairs therefore run in parallel across learners (and decoding across sources), in turn
for one learner.

A failed job names its pair (or source) in one line (`ConversionJobError`) when it is joined,
and `check()` at the end of the exchange phase raises any failure of a pair the step did not
ask for, so every failure stops the step before the update.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from verl import DataProto

from recipe_hacpo.exchange.retokenize import Prepared, RowConverter

_READ_TENSORS = ("prompts", "responses", "response_mask", "attention_mask", "input_ids", "position_ids")
"""The source tensors `RowConverter.prepare` reads (the shared path copies all six layout keys),
which `convert` checks are unchanged."""
_READ_NON_TENSOR = ("raw_prompt",)


class ConversionJobError(RuntimeError):
    """A background conversion failed or its input changed; the message is one line naming it."""


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _fingerprint(batch: DataProto) -> dict[str, tuple]:
    """What `prepare` read of `batch`: each tensor's object, shape and checksum; the message array."""
    out: dict[str, tuple] = {}
    for key in _READ_TENSORS:
        if key in batch.batch.keys():
            value = batch.batch[key]
            data = value.detach().contiguous().numpy()
            out[key] = (value, tuple(value.shape), zlib.crc32(data.data))
    for key in _READ_NON_TENSOR:
        if key in batch.non_tensor_batch:
            out[key] = (batch.non_tensor_batch[key], len(batch.non_tensor_batch[key]), None)
    return out


def _changed(batch: DataProto, before: dict[str, tuple]) -> str | None:
    """The first field `prepare` read that `batch` no longer holds as it was (None: unchanged)."""
    for key, (obj, shape, crc) in before.items():
        now = batch.batch[key] if key in _READ_TENSORS and key in batch.batch.keys() else batch.non_tensor_batch.get(key)
        if now is not obj:
            return f"{key} was replaced"
        if crc is not None and (tuple(now.shape) != shape or zlib.crc32(now.detach().contiguous().numpy().data) != crc):
            return f"{key} was changed in place"
    return None


@dataclass
class _Source:
    batch: cf.Future  # the rollouts (at once, or loaded by a job: a recorded peer)
    fingerprint: cf.Future
    texts: cf.Future
    pairs: dict[str, cf.Future] = field(default_factory=dict)
    checked: bool = False


class ConversionJobs:
    """The background conversions of the current step, one thread pool for the trainer's life.

    converters: the trainer's converters, keyed (source, learner).
    decode: `decode(batch, tokenizer) -> list[str]`, the scorer's decoding (`scoring.decode_responses`):
        the text scoring and every re-tokenizing learner use.
    workers: threads (≥ 1).
    """

    def __init__(
        self,
        converters: dict[tuple[str, str], RowConverter],
        decode: Callable[[DataProto, Any], list[str]],
        workers: int,
    ) -> None:
        if workers < 1:
            raise ValueError(f"exchange workers must be at least 1, got {workers}")
        self.converters = converters
        self.decode = decode
        self.workers = int(workers)
        # two pools: what scoring waits for (loading, checking, decoding) never queues behind the
        # long re-tokenizations, which wait only on the first pool's jobs (no deadlock)
        self._reading = cf.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="hacpo-exchange-read")
        self._executor = cf.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="hacpo-exchange")
        self._locks: dict[int, tuple[Any, threading.Lock]] = {}
        self._guard = threading.Lock()
        self._sources: dict[str, _Source] = {}
        self.step = 0
        self.wait_s = 0.0
        self.busy_s = 0.0

    # ------------------------------------------------------------------ step bookkeeping
    def begin_step(self, step: int) -> None:
        """Forget the previous step (its jobs are all done: `check` or `abandon` ran)."""
        self.abandon()
        self.step = step
        self.wait_s = 0.0
        self.busy_s = 0.0

    def abandon(self) -> None:
        """Cancel what has not started and wait for what has (a failed step, or the next one)."""
        sources, self._sources = self._sources, {}
        futures = [f for s in sources.values() for f in (s.batch, s.fingerprint, s.texts, *s.pairs.values())]
        for f in futures:
            f.cancel()
        cf.wait(futures)

    def close(self) -> None:
        self.abandon()
        self._reading.shutdown(wait=True)
        self._executor.shutdown(wait=True)

    def _lock(self, tokenizer: Any) -> threading.Lock:
        with self._guard:
            held = self._locks.get(id(tokenizer))
            if held is None or held[0] is not tokenizer:
                held = (tokenizer, threading.Lock())  # the reference keeps the id from being reused
                self._locks[id(tokenizer)] = held
            return held[1]

    def _timed(self, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        try:
            return fn()
        finally:
            with self._guard:
                self.busy_s += time.perf_counter() - start

    # ------------------------------------------------------------------ submitting
    def start(
        self,
        source: str,
        batch: DataProto | Callable[[], DataProto],
        learners: Sequence[str],
        source_tokenizer: Any,
    ) -> None:
        """Submit the decoding of `source`'s rollouts and their conversion for each of `learners`.

        batch: the rollouts, or a function that loads them (run as the first job: a recorded peer).
        Thread-safe (the trainer calls it from each agent's generate thread). Loading, checking and
        decoding run on one pool, each waiting only on jobs submitted to it before (its
        first-in-first-out order never deadlocks); conversions on the other, waiting on the first
        pool's jobs only. No job waits while it holds a tokenizer's lock.
        """
        if callable(batch):
            rollouts = self._reading.submit(batch)
        else:
            rollouts = cf.Future()
            rollouts.set_result(batch)
        fingerprint = self._reading.submit(lambda: _fingerprint(rollouts.result()))

        def decode() -> list[str]:
            rows = rollouts.result()
            with self._lock(source_tokenizer):
                return self._timed(lambda: self.decode(rows, source_tokenizer))

        entry = _Source(batch=rollouts, fingerprint=fingerprint, texts=self._reading.submit(decode))
        for learner in learners:
            exchange = self.converters[(source, learner)]
            entry.pairs[learner] = self._executor.submit(self._prepare, exchange, rollouts, entry.texts)
        with self._guard:
            self._sources[source] = entry

    def _prepare(self, exchange: RowConverter, rollouts: cf.Future, texts: cf.Future) -> Prepared:
        batch = rollouts.result()
        if exchange.shared:  # the same tokens, re-laid out: no tokenizer call
            return self._timed(lambda: exchange.prepare(batch))
        decoded = texts.result()
        with self._lock(exchange.learner_tokenizer):
            return self._timed(lambda: exchange.prepare(batch, texts=decoded))

    # ------------------------------------------------------------------ joining
    def started(self, source: str) -> bool:
        return source in self._sources

    def _join(self, future: cf.Future, what: str, counted: bool = True) -> Any:
        """The job's result; `counted`: its wait is the exchange's (`wait_s`), not scoring's."""
        start = time.perf_counter()
        try:
            return future.result()
        except Exception as exc:
            raise ConversionJobError(f"exchange {what}, step {self.step}: {_one_line(exc)}") from exc
        finally:
            if counted:
                self.wait_s += time.perf_counter() - start

    def batch(self, source: str) -> DataProto:
        """`source`'s rollouts (waits for their loading when `start` got a loader)."""
        return self._join(self._sources[source].batch, f"loading {source}'s rollouts", counted=False)

    def texts(self, source: str) -> list[str]:
        """The response text of `source`'s rollouts (waits for its decoding)."""
        return self._join(self._sources[source].texts, f"decoding {source}'s responses", counted=False)

    def convert(self, source: str, learner: str, batch: DataProto, rows: torch.Tensor | None = None) -> DataProto:
        """`converters[(source, learner)].convert(batch if rows is None else batch.select_idxs(rows))`,
        from the conversion prepared in the background; `batch` is the source's whole rollout
        batch as it is now (the one passed to `start`, with the fields added since)."""
        entry = self._sources[source]
        what = f"{source} → {learner}"
        if batch is not self._join(entry.batch, f"loading {source}'s rollouts"):
            raise ConversionJobError(f"exchange {what}, step {self.step}: not the rollout batch the conversion started from")
        if not entry.checked:
            change = _changed(batch, self._join(entry.fingerprint, f"{source}'s inputs"))
            if change is not None:
                raise ConversionJobError(
                    f"exchange {what}, step {self.step}: {source}'s {change} between generate and exchange; "
                    "the background conversion would differ from the serial one"
                )
            entry.checked = True
        if learner not in entry.pairs:
            raise ConversionJobError(f"exchange {what}, step {self.step}: no conversion was started for this pair")
        prepared: Prepared = self._join(entry.pairs[learner], what)
        exchange = self.converters[(source, learner)]
        if rows is None:
            return exchange.finish(batch, prepared)
        return exchange.finish(batch.select_idxs(rows), prepared.select(rows))

    def check(self) -> None:
        """Wait for every job of the step; raise the first failure (in start order), so that a pair
        the step did not ask for still stops it before the update."""
        for source, entry in list(self._sources.items()):
            self._join(entry.batch, f"loading {source}'s rollouts")
            self._join(entry.texts, f"decoding {source}'s responses")
            for learner, future in entry.pairs.items():
                self._join(future, f"{source} → {learner}")


def exchange_workers(value: Any, agents: int) -> int:
    """`trainer.exchange_workers` as a thread count: null → one per agent (the jobs of one learner
    take turns on its tokenizer, so more threads buy nothing), 0 → none (every conversion runs in
    the exchange phase, serially, as `RowConverter.convert`). ConfigError for anything else."""
    from recipe_hacpo.hacpo_settings import ConfigError

    if value is None:
        return max(1, agents)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"trainer.exchange_workers={value!r}: must be null (one thread per agent), 0 (convert in the "
            "exchange phase) or a positive number of threads"
        )
    return int(value)


__all__ = ["ConversionJobs", "ConversionJobError", "exchange_workers"]
