"""Mathematical equivalence of two extracted answers, via math-verify.

:func:`equivalent` has no time bound of its own (math-verify's signal timeouts are switched off
so that it can run in any thread); callers bound it with :mod:`timeouts`. This module imports
only the standard library and math-verify, so a worker process can load it by file path.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_BRACE_DEPTH = 16
"""Answers nested deeper than this are refused: sympy's simplification of deeply nested
fractions/radicals is where comparison time explodes (depth 30 already runs for minutes)."""

_NUMBER = r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[+-]?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_NUMBER_WITH_WORDS_RE = re.compile(rf"({_NUMBER})\s+[A-Za-z]{{2,}}(?:\s+[A-Za-z]+)*")
_CURRENCY_PREFIXES = ("\\$", "$")


def brace_depth(text: str) -> int:
    """Maximum ``{``/``}`` nesting depth, ignoring backslash-escaped braces."""
    depth = best = 0
    escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == "{":
            depth += 1
            if depth > best:
                best = depth
        elif ch == "}":
            depth = max(depth - 1, 0)
    return best


def screen(answer: str) -> str | None:
    """Reason to refuse ``answer`` before any parsing, or None when it may be parsed."""
    if brace_depth(answer) > MAX_BRACE_DEPTH:
        return "answer_too_complex"
    return None


def normalize(answer: str) -> str:
    """Light cleanup math-verify does not do itself: math mode ``$..$``, percent signs,
    currency prefixes, LaTeX spacing/thousands marks, a trailing period, and plain-text units
    after a bare number (``18 dollars``)."""
    s = answer.strip()
    if len(s) >= 2 and s.startswith("$") and s.endswith("$"):
        s = s.strip("$").strip()
    for prefix in _CURRENCY_PREFIXES:
        if s.startswith(prefix):
            s = s[len(prefix) :].lstrip()
            break
    s = s.replace("\\%", "").replace("%", "").replace("\\!", "").replace("{,}", ",")
    s = s.rstrip(".").strip()
    m = _NUMBER_WITH_WORDS_RE.fullmatch(s)
    if m:
        s = m.group(1)
    return s


def _as_number(s: str) -> Fraction | None:
    compact = s.replace(" ", "")
    if not _NUMBER_RE.fullmatch(compact):
        return None
    try:
        return Fraction(compact.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def _fast_verdict(gold: str, pred: str) -> bool | None:
    """Decide plain numeric literals without sympy; None when math-verify must decide."""
    g, p = _as_number(gold), _as_number(pred)
    if g is None or p is None:
        return None
    if g == p:
        return True
    if g.denominator == 1 and p.denominator == 1:
        return False
    return None


def _math_verify():
    """math-verify's ``parse``/``verify``, imported on first use (sympy is slow to import).

    Its one-time warning about disabled signal timeouts is silenced: bounding the time is the
    caller's job here, by design."""
    from math_verify import grader, parser

    for module in (grader, parser):
        if hasattr(module, "TIMEOUT_WARNING_SHOWN"):
            module.TIMEOUT_WARNING_SHOWN = True
    return parser.parse, grader.verify


def equivalent(gold: str, pred: str) -> tuple[bool, str]:
    """Whether ``pred`` is mathematically equivalent to ``gold`` (both extracted answers).

    Returns ``(is_equivalent, reason)`` with reason ``correct``, ``mismatch`` or
    ``parse_error`` (nothing in ``pred`` could be parsed).
    """
    gold_n, pred_n = normalize(gold), normalize(pred)
    if not pred_n:
        return False, "parse_error"
    fast = _fast_verdict(gold_n, pred_n)
    if fast is not None:
        return fast, "correct" if fast else "mismatch"

    parse, verify = _math_verify()
    gold_parsed = parse("\\boxed{" + gold_n + "}", parsing_timeout=None)
    pred_parsed = parse("\\boxed{" + pred_n + "}", parsing_timeout=None)
    if not pred_parsed:
        return False, "parse_error"
    if not gold_parsed:
        ok = gold_n.replace(" ", "") == pred_n.replace(" ", "")
        return ok, "correct" if ok else "mismatch"
    ok = bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))
    if ok:
        return True, "correct"
    if all(isinstance(item, str) for item in pred_parsed):
        return False, "parse_error"
    return False, "mismatch"


def warmup() -> None:
    """Import and exercise math-verify once (sympy, the LaTeX grammar) so first calls are fast."""
    equivalent("\\frac{1}{2}", "0.5")
