"""docs/CONFIG.md is the generated reference of every key the recipe adds, and it covers them all."""

from __future__ import annotations

from pathlib import Path

from helpers.compose import compose_config

from recipe_hacpo.config_reference import reference, verl_trainer_keys

REPO = Path(__file__).resolve().parents[1]


def test_the_page_is_what_the_code_generates():
    assert (REPO / "docs" / "CONFIG.md").read_text() == reference(), (
        "docs/CONFIG.md is stale: python -m recipe_hacpo.config_reference > docs/CONFIG.md")


def test_every_trainer_key_the_recipe_adds_has_a_documented_default_and_meaning():
    """A key added to hacpo_base.yaml's trainer section without a comment above it would be
    missing from the page: every such key of the composed config is on it."""
    page = (REPO / "docs" / "CONFIG.md").read_text()
    cfg = compose_config("hacpo_trainer")
    ours = [k for k in cfg.trainer if k not in verl_trainer_keys()]
    assert ours and all(f"| `trainer.{k}` |" in page for k in ours), [k for k in ours if f"`trainer.{k}`" not in page]
    for group in ("preemption", "rollout_check"):
        assert all(f"| `trainer.{group}.{k}` |" in page for k in cfg.trainer[group]), group
    assert all(f"| `{k}` |" in page for k in cfg if k.startswith("agents"))
