"""Pull a final answer out of a model response or a ground-truth string.

Everything here is plain string scanning with linear cost in the (already capped) input: no
backtracking-prone regexes run on model output, nothing parses math. Functions return ``None``
when there is no answer of the requested kind.
"""

from __future__ import annotations

import re

TAIL_CHARS = 8192
"""Only this many trailing characters of a response are searched for its final answer."""

MAX_ANSWER_CHARS = 1000
"""Longer extracted answers are rejected before any parsing."""

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_MAX_BOX_CANDIDATES = 256
_HASH_MARK = "####"

_INT_RE = re.compile(r"(?<![0-9A-Za-z)\]}])-\d+|\d+")
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")


def as_text(value: object) -> str:
    """Coerce whatever verl hands over (str, numpy str, bytes, None, numbers) to ``str``."""
    if value is None:
        return ""
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    try:
        return str(value)
    except Exception:
        return ""


def tail(text: str, limit: int = TAIL_CHARS) -> str:
    return text if len(text) <= limit else text[-limit:]


def _braced_group(text: str, open_idx: int) -> str | None:
    """Content of the ``{...}`` group whose ``{`` is at ``open_idx``; ``None`` if never closed.

    A backslash escapes the next character, so ``\\{`` and ``\\}`` do not count as grouping.
    """
    depth = 0
    i = open_idx
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[open_idx + 1 : i]
        i += 1
    return None


def _bare_argument(text: str, start: int) -> str | None:
    """Argument of ``\\boxed 5`` style usage: up to the next ``$`` or line break."""
    end = len(text)
    for stop in ("$", "\n"):
        j = text.find(stop, start)
        if j != -1 and j < end:
            end = j
    arg = text[start:end].strip().rstrip(".").strip()
    return arg or None


def _box_at(text: str, idx: int, command: str) -> tuple[bool, str | None]:
    """Interpret the box command starting at ``idx``.

    Returns ``(is_box, content)``: ``is_box`` is False when the match is only a prefix of some
    other command (``\\boxedx``); ``content`` is None for an unclosed or empty box.
    """
    j = idx + len(command)
    n = len(text)
    if j < n and (text[j].isalpha() or text[j] == "@"):
        return False, None
    k = j
    while k < n and text[k] in " \t":
        k += 1
    if k >= n:
        return True, None
    if text[k] == "{":
        return True, _braced_group(text, k)
    if k > j:
        return True, _bare_argument(text, k)
    return False, None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{..}`` / ``\\fbox{..}`` / ``\\boxed ..`` in ``text``.

    Only the last box counts: if it is unclosed (a truncated response) there is no answer.
    A box directly wrapping another box is unwrapped.
    """
    end = len(text)
    for _ in range(_MAX_BOX_CANDIDATES):
        best_idx, best_cmd = -1, ""
        for cmd in _BOX_COMMANDS:
            idx = text.rfind(cmd, 0, end)
            if idx > best_idx:
                best_idx, best_cmd = idx, cmd
        if best_idx < 0:
            return None
        is_box, content = _box_at(text, best_idx, best_cmd)
        if is_box:
            return unwrap_boxed(content) if content is not None else None
        end = best_idx
    return None


def unwrap_boxed(answer: str) -> str:
    """Strip box commands that wrap the whole string: ``\\boxed{\\boxed{5}}`` -> ``5``."""
    current = answer.strip()
    for _ in range(8):
        cmd = next((c for c in _BOX_COMMANDS if current.startswith(c)), None)
        if cmd is None:
            return current
        k = len(cmd)
        while k < len(current) and current[k] in " \t":
            k += 1
        if k >= len(current) or current[k] != "{":
            return current
        content = _braced_group(current, k)
        if content is None or k + len(content) + 2 != len(current):
            return current
        current = content.strip()
    return current


def hash_answer(text: str) -> str | None:
    """Text after the last GSM8K ``####`` marker, up to the end of that line."""
    idx = text.rfind(_HASH_MARK)
    if idx < 0:
        return None
    start = idx + len(_HASH_MARK)
    end = text.find("\n", start)
    segment = text[start:] if end < 0 else text[start:end]
    segment = segment.strip()
    return segment or None


def first_number(text: str) -> str | None:
    """First number in ``text`` with thousands separators removed (``$1,234.5`` -> ``1234.5``)."""
    m = _NUMBER_RE.search(text)
    return m.group(0).replace(",", "") if m else None


def last_integer(text: str) -> str | None:
    """Last integer literal in ``text``, digits kept verbatim (leading zeros matter).

    A minus sign counts only when it cannot be a binary minus (``12-0579`` ends in ``0579``).
    """
    last = None
    for m in _INT_RE.finditer(text):
        last = m.group(0)
    return last


def gsm8k_style_answer(text: str) -> str | None:
    """Whichever of the last box and the last ``####`` line comes later in ``text``.

    A ``####`` line is reduced to its first number when it has one (``#### $1,234 total``).
    """
    box_pos = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    hash_pos = text.rfind(_HASH_MARK)
    if hash_pos > box_pos:
        segment = hash_answer(text)
        if segment is None:
            return None
        return first_number(segment) or segment
    return last_boxed(text)


def ground_truth_answer(ground_truth: str) -> str:
    """Reference answer from a ground-truth field that may be plain, boxed, or GSM8K ``####``."""
    gt = ground_truth.strip()
    if _HASH_MARK in gt:
        segment = hash_answer(gt)
        if segment is not None:
            return first_number(segment) or segment
    if any(cmd in gt for cmd in _BOX_COMMANDS):
        boxed = last_boxed(gt)
        if boxed is not None:
            return boxed
    return gt
