"""Every fact of a method is the method's own (recipe_hacpo/methods/): no module outside that
package branches on `algorithm.hacpo.mode`; it asks `method_for(settings.mode)` instead."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from recipe_hacpo.hacpo_settings import MODES, HacpoSettings
from recipe_hacpo.methods import checked_settings, loss_settings, method_for

REPO = Path(__file__).resolve().parents[1]
COMPARISONS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)

ALLOWED: dict[str, str] = {}
"""Comparisons with a mode allowed outside the methods, `path:line` → why. None today."""


def _outside_methods() -> list[Path]:
    """Every module of the recipe outside recipe_hacpo/methods/, and the worker role's."""
    package = REPO / "recipe_hacpo"
    found = [p for p in package.rglob("*.py") if p.resolve().is_relative_to(package) and "methods" not in p.relative_to(package).parts[:1]]
    return sorted(found + list((REPO / "workers").rglob("*.py")))


def _names_a_mode(node: ast.AST) -> bool:
    """A mode's name as a string, a tuple/list/set holding one, or any `<something>.mode`."""
    if isinstance(node, ast.Constant):
        return node.value in MODES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_mode(e) for e in node.elts)
    return isinstance(node, ast.Attribute) and node.attr == "mode"


def mode_comparisons(source: str) -> list[int]:
    """Lines of `source` comparing (==, !=, in, not in) something with a mode name or a `.mode`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, COMPARISONS) for op in node.ops):
            if any(_names_a_mode(side) for side in (node.left, *node.comparators)):
                lines.append(node.lineno)
    return lines


def test_no_module_outside_the_methods_compares_a_mode():
    found = []
    for path in _outside_methods():
        rel = path.relative_to(REPO)
        found += [f"{rel}:{line}" for line in mode_comparisons(path.read_text()) if f"{rel}:{line}" not in ALLOWED]
    assert not found, f"mode compared outside recipe_hacpo/methods/ (ask method_for(mode)): {found}"


def test_the_check_sees_a_mode_comparison():
    assert _outside_methods() and all("methods" not in p.relative_to(REPO).parts[:2] for p in _outside_methods())
    assert mode_comparisons('padded = hacpo.mode in ("hacpo", "naive")') == [1]
    assert mode_comparisons('x = 1\nif mode == "graft":\n    pass') == [2]
    assert mode_comparisons('if "sgt" != m: pass') == [1]
    assert mode_comparisons('if settings.mode not in allowed: pass') == [1]
    assert mode_comparisons('if mode in ("main", "evaluate") or name == "hacpo_x": pass') == []


@pytest.mark.parametrize("mode, shares, joint_groups, joint_only", [
    ("hacpo", True, True, False), ("naive", True, True, False), ("isolated", False, False, False),
    ("graft", True, False, True), ("sgt", True, False, True),
])
def test_each_method_declares_how_it_shares(mode, shares, joint_groups, joint_only):
    method = method_for(mode)
    assert (method.shares, method.joint_groups, method.joint_only) == (shares, joint_groups, joint_only)
    assert (loss_settings(HacpoSettings(mode=mode)) is None) is not shares  # no sharing: verl's own loss


def test_only_naive_implies_settings():
    for mode in MODES:
        settings = HacpoSettings(mode=mode, alpha=2.0)
        effective = method_for(mode).effective(settings)
        assert (effective == settings) is (mode != "naive"), mode
    naive = method_for("naive").effective(HacpoSettings(mode="naive", alpha=2.0))
    assert (naive.alpha, naive.cross_clip, naive.capability_baseline, naive.discrepancy_coefficient) == (0.0, "gspo", False, False)
    # what a Naive actor worker rebuilds is the implied settings
    assert checked_settings(loss_settings(HacpoSettings(mode="naive", alpha=2.0))) == naive


@pytest.mark.parametrize("mode, key, value, accepted", [
    ("hacpo", "share_selection", "complementary", True), ("naive", "share_selection", "complementary", True),
    ("graft", "share_selection", "complementary", True), ("isolated", "share_selection", "complementary", False),
    ("sgt", "share_selection", "complementary", False), ("graft", "replay_peer", "/r/a", True),
    ("hacpo", "replay_peer", "/r/a", False), ("naive", "cross_clip", "gspo", True), ("hacpo", "cross_clip", "gspo", False),
])
def test_each_method_says_which_settings_it_takes(mode, key, value, accepted):
    raw = {"mode": mode, key: value}
    HacpoSettings.from_dict(raw)  # each key on its own is fine: the rule is the method's
    if accepted:
        assert getattr(checked_settings(raw), key) == value
    else:
        with pytest.raises(ValueError, match=rf"^algorithm\.hacpo\.{key}="):
            checked_settings(raw)
