"""Verifiable math reward for verl: ``reward.custom_reward_function.name=compute_score``.

verl's reward managers call ``compute_score(data_source=..., solution_str=..., ground_truth=...,
extra_info=..., **extra)`` where ``extra`` holds ``reward.custom_reward_function.reward_kwargs``
and, with a reward router, ``reward_router_address``/``reward_model_tokenizer``. The returned
dict is stored per sample: ``score`` becomes the reward, every other key becomes a
``reward_extra_info`` column (numbers are averaged in validation metrics, strings are kept for
dumps, ``pred`` feeds majority voting). Every call returns the same keys.

How the answer is found and compared depends on ``data_source`` (see ``SOURCES``).
"""

# verl loads this file by path without registering it in sys.modules: annotations must stay
# eagerly evaluated (no ``from __future__ import annotations``) and no dataclasses here.
import math
import os
import re
import sys
import time
from typing import NamedTuple

try:
    from recipe_hacpo.reward import answer_extraction, equivalence, timeouts
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import answer_extraction
    import equivalence
    import timeouts

DEFAULT_TIMEOUT_S = 5.0
"""Per-sample wall-clock budget for comparing answers; override with ``timeout_s=``."""

MAX_TIMEOUT_S = 600.0

MAX_PRED_CHARS = 200
"""Length cap of the ``pred`` string put into the result (it ends up in numpy arrays/logs)."""


class AnswerSpec(NamedTuple):
    """How a family of data sources states and checks answers.

    ``extract``: ``boxed`` (last box only), ``boxed_or_hash`` (later of last box and last GSM8K
    ``####`` line) or ``boxed_or_last_int`` (last box, else the last integer in the text).
    ``compare``: ``math`` (math-verify equivalence) or ``exact`` (string equality ignoring
    whitespace, so leading zeros matter).
    """

    family: str
    extract: str
    compare: str


_MATH = AnswerSpec("math", "boxed", "math")

SOURCES: tuple[tuple[re.Pattern[str], AnswerSpec], ...] = (
    (re.compile(r"^hacpo/arith"), AnswerSpec("arith", "boxed_or_last_int", "exact")),
    (re.compile(r"gsm8k"), AnswerSpec("gsm8k", "boxed_or_hash", "math")),
    (re.compile(r"aime"), AnswerSpec("aime", "boxed", "math")),
    (re.compile(r"amc"), AnswerSpec("amc", "boxed", "math")),
    (re.compile(r"minerva"), AnswerSpec("minerva", "boxed", "math")),
    (re.compile(r"olympiad"), AnswerSpec("olympiadbench", "boxed", "math")),
    (re.compile(r"math"), _MATH),
)
"""First match wins, searched in the lower-cased ``data_source``: ``math``, ``lighteval/MATH``,
``HuggingFaceH4/MATH-500``, ``openai/gsm8k``, ``gsm8k``, ``aime25``, ``amc23``, ``minerva``,
``olympiadbench`` and variants with prefixes/suffixes. Synthetic arithmetic is ``hacpo/arith*``."""

DEFAULT_SPEC = AnswerSpec("default", "boxed", "math")


def spec_for(data_source: object) -> AnswerSpec:
    name = answer_extraction.as_text(data_source).strip().lower()
    for pattern, spec in SOURCES:
        if pattern.search(name):
            return spec
    return DEFAULT_SPEC


def _result(correct: bool, pred: str, reason: str) -> dict:
    return {
        "score": 1.0 if correct else 0.0,
        "acc": 1.0 if correct else 0.0,
        "pred": pred[:MAX_PRED_CHARS],
        "reason": reason,
    }


def _ground_truths(ground_truth: object) -> list[str]:
    """Reference answers; a list/array of ground truths means any of them is accepted."""
    if isinstance(ground_truth, (list, tuple)) or type(ground_truth).__name__ == "ndarray":
        items = list(ground_truth)[:16]
    else:
        items = [ground_truth]
    answers = []
    for item in items:
        text = answer_extraction.as_text(item)[: answer_extraction.TAIL_CHARS]
        answer = answer_extraction.ground_truth_answer(text)
        if answer:
            answers.append(answer)
    return answers


def _extract(spec: AnswerSpec, text: str) -> str | None:
    if spec.extract == "boxed_or_hash":
        return answer_extraction.gsm8k_style_answer(text)
    answer = answer_extraction.last_boxed(text)
    if answer is None and spec.extract == "boxed_or_last_int":
        answer = answer_extraction.last_integer(text)
    return answer


def _no_answer_reason(spec: AnswerSpec) -> str:
    return "no_boxed_answer" if spec.extract == "boxed" else "no_answer"


def settings(kwargs: dict) -> tuple[float, str]:
    """``(timeout_s, isolation)`` from the call's keyword arguments (verl's ``reward_kwargs``).

    A setting is configuration, not model output: an invalid one raises ``ValueError`` naming
    it, rather than quietly meaning the default.
    """
    raw = kwargs.get("timeout_s", DEFAULT_TIMEOUT_S)
    try:
        timeout_s = float(raw)
    except (TypeError, ValueError):
        timeout_s = float("nan")
    if not math.isfinite(timeout_s) or not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout_s={raw!r}: must be a number of seconds in (0, {MAX_TIMEOUT_S:g}]")
    isolation = kwargs.get("isolation", "auto")
    if isolation not in timeouts.ISOLATION_MODES:
        raise ValueError(f"isolation={isolation!r}: must be one of {', '.join(timeouts.ISOLATION_MODES)}")
    return timeout_s, isolation


_warm = False


def _warm_up_in_process(isolation: str) -> None:
    """Import math-verify/sympy here once, outside any deadline, when calls will run in-process
    (an alarm landing in the middle of importing sympy would leave it half-initialised)."""
    global _warm
    runs_here = isolation in ("thread", "inline") or (isolation != "process" and timeouts.on_main_thread())
    if _warm or not runs_here:
        return
    _warm = True
    equivalence.warmup()


def _compare_math(golds: list[str], pred: str, timeout_s: float, isolation: str) -> tuple[bool, str]:
    refused = equivalence.screen(pred)
    if refused:
        return False, refused
    _warm_up_in_process(isolation)
    deadline = time.monotonic() + timeout_s
    reason = "mismatch"
    for gold in golds:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False, "timeout"
        outcome = timeouts.run_bounded(equivalence, "equivalent", [gold, pred], remaining, isolation)
        if outcome.status == "timeout":
            return False, "timeout"
        if outcome.status != "ok":
            reason = f"error:{outcome.detail}" if outcome.detail else "error"
            continue
        ok, reason = outcome.value
        if ok:
            return True, "correct"
    return False, reason


def _score(data_source, solution_str, ground_truth, timeout_s: float, isolation: str) -> dict:
    spec = spec_for(data_source)
    golds = _ground_truths(ground_truth)
    if not golds:
        return _result(False, "", "empty_ground_truth")

    text = answer_extraction.tail(answer_extraction.as_text(solution_str))
    pred = _extract(spec, text)
    if pred is None or not pred.strip():
        return _result(False, "", _no_answer_reason(spec))
    pred = pred.strip()
    if len(pred) > answer_extraction.MAX_ANSWER_CHARS:
        return _result(False, pred, "answer_too_long")

    if spec.compare == "exact":
        compact = "".join(pred.split())
        ok = any(compact == "".join(gold.split()) for gold in golds)
        return _result(ok, compact, "correct" if ok else "mismatch")

    ok, reason = _compare_math(golds, pred, timeout_s, isolation)
    return _result(ok, pred, reason)


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    """Score one response: 1.0 if its final answer matches the ground truth, else 0.0.

    Args:
        data_source: dataset name, selects extraction and comparison (``SOURCES``).
        solution_str: the decoded response.
        ground_truth: reference answer: plain, ``\\boxed{..}``, GSM8K ``#### ..``, or a list
            of acceptable answers.
        extra_info: unused.
        **kwargs: ``timeout_s`` (float, default ``DEFAULT_TIMEOUT_S``) and ``isolation``
            (``auto``/``process``/``thread``/``inline``, see ``timeouts.run_bounded``) are read;
            anything else verl passes (``reward_router_address``, ...) is ignored.

    Returns:
        ``{"score": float, "acc": float, "pred": str, "reason": str}``; never raises on
        model output (``ValueError`` on an invalid ``timeout_s`` / ``isolation`` setting). ``reason`` is ``correct``, ``mismatch``, ``no_boxed_answer``,
        ``no_answer``, ``parse_error``, ``timeout``, ``answer_too_long``,
        ``answer_too_complex``, ``empty_ground_truth`` or ``error:<detail>``.
    """
    timeout_s, isolation = settings(kwargs)
    try:
        return _score(data_source, solution_str, ground_truth, timeout_s, isolation)
    except Exception as exc:
        return _result(False, "", f"error:{type(exc).__name__}")
