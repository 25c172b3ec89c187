"""Per-agent metrics are named `agent/<name>/<key>` in one place (`methods/context.py`:
`agent_key` writes the name, `agent_of` reads it back), so writers and readers never disagree."""

from __future__ import annotations

import ast
from pathlib import Path

from recipe_hacpo.methods.context import agent_key, agent_of, prefixed, unprefixed

REPO = Path(__file__).resolve().parents[1]
HOME = REPO / "recipe_hacpo" / "methods" / "context.py"


def _modules() -> list[Path]:
    """Every module of recipe_hacpo/ and workers/ (each once: not through a link)."""
    package = REPO / "recipe_hacpo"
    found = [p for p in package.rglob("*.py") if p.resolve().is_relative_to(package)]
    return sorted(found + list((REPO / "workers").rglob("*.py")))


def hand_built_agent_keys(source: str) -> list[int]:
    """Lines of `source` holding an f-string that starts with "agent/" and then a formatted value."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr) and len(node.values) >= 2:
            head, then = node.values[0], node.values[1]
            if isinstance(head, ast.Constant) and head.value == "agent/" and isinstance(then, ast.FormattedValue):
                lines.append(node.lineno)
    return lines


def test_no_agent_key_is_built_by_hand():
    found = [f"{p.relative_to(REPO)}:{line}" for p in _modules() if p != HOME
             for line in hand_built_agent_keys(p.read_text())]
    assert not found, f"agent/<name>/ written by hand (use methods.context.agent_key / prefixed): {found}"


def test_the_check_sees_a_hand_built_key():
    assert HOME in _modules()
    assert hand_built_agent_keys('k = f"agent/{name}/reward/mean"') == [1]
    assert hand_built_agent_keys('x = 1\nk = f"agent/{a}/{b}"') == [2]
    assert hand_built_agent_keys('k = f"{p}agent/{name}"\nj = f"agents.{name}.rollout_n"\nm = "agent/a/b"') == []


def test_agent_keys_round_trip():
    assert agent_key("qwen", "val/math/mean@4") == "agent/qwen/val/math/mean@4"
    assert agent_of("agent/qwen/val/math/mean@4") == ("qwen", "val/math/mean@4")
    assert agent_of("timing_s/step") is None and agent_of("agent/qwen") is None and agent_of("agents/a/b") is None
    metrics = prefixed({"a": {"reward/mean": 0.5}, "b": {"omega/a": 2.0}}) | {"timing_s/step": 1.0}
    assert metrics == {"agent/a/reward/mean": 0.5, "agent/b/omega/a": 2.0, "timing_s/step": 1.0}
    assert unprefixed(metrics, "b") == {"omega/a": 2.0} and unprefixed(metrics, "c") == {}
