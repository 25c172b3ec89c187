"""`algorithm.hacpo` is declared once (recipe_hacpo/hacpo_settings.py): the YAML node, the
presets, the core functions' keyword defaults, the worker's settings and the docs table all
follow that declaration, and one validation rejects a bad value or an unknown key with one
line naming `algorithm.hacpo.<key>`."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from helpers.compose import compose_config as _compose
from omegaconf import OmegaConf

from recipe_hacpo.methods import checked_settings, core_algos, loss_settings, method_for
from recipe_hacpo.config import validate
from recipe_hacpo.hacpo_settings import (
    DEFAULTS,
    NAIVE_CROSS_CLIP,
    USER_CROSS_CLIPS,
    ConfigError,
    HacpoSettings,
    defaults_node,
    markdown_table,
)

ROOT = Path(__file__).resolve().parents[1]
KEYS = [f.name for f in fields(HacpoSettings)]




def test_every_key_has_a_meaning_a_section_and_a_valid_default():
    for f in fields(HacpoSettings):
        assert len(f.metadata["meaning"]) > 10, f.name
        assert re.fullmatch(r"§\d", f.metadata["section"]), f.name
    assert HacpoSettings.from_dict({}) == DEFAULTS  # the defaults pass their own rules


def test_docs_table_is_the_declaration():
    doc = (ROOT / "docs" / "ALGORITHM.md").read_text()
    assert markdown_table() in doc, (
        "docs/ALGORITHM.md: the algorithm.hacpo table differs from recipe_hacpo/hacpo_settings.py; paste "
        "python -c 'from recipe_hacpo.hacpo_settings import markdown_table; print(markdown_table())'"
    )
    # a doc table row per key, and no row for a key that is not declared
    rows = re.findall(r"^\| `(\w+)` \| `[^`]*` \| §\d \|", doc, flags=re.M)
    assert rows == KEYS


def test_composed_node_is_the_declaration_and_no_yaml_repeats_it():
    composed = OmegaConf.to_container(_compose("hacpo_trainer", []).algorithm.hacpo)
    assert composed == defaults_node()
    base = OmegaConf.load(ROOT / "configs" / "hacpo_base.yaml")
    assert "hacpo" not in base.algorithm, "configs/hacpo_base.yaml redeclares algorithm.hacpo defaults"


def _hacpo_blocks():
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        block = OmegaConf.select(OmegaConf.load(path), "algorithm.hacpo", default=None)
        if block is not None:
            yield path.relative_to(ROOT / "configs").as_posix(), OmegaConf.to_container(block)


def test_presets_set_only_their_own_values_and_each_is_valid():
    blocks = dict(_hacpo_blocks())
    assert len(blocks) >= 10  # every pair preset and every baseline
    for name, block in blocks.items():
        HacpoSettings.from_dict(block)  # known keys, valid values
        if name.startswith("baseline/"):
            assert set(block) == {"mode"}, name  # a baseline is a mode
        else:
            # a pair preset sets the paper's per-pair α, δ, δ_step and nothing else
            assert set(block) <= {"alpha", "delta", "delta_step"}, name


# the core functions' parameter -> the algorithm.hacpo key that gives its default
CORE_PARAMETERS = {
    "window": "window",
    "floor": "capability_floor",
    "omega_clip": "omega_clip",
    "use_capability_baseline": "capability_baseline",
    "norm_by_std": "norm_by_std",
    "baseline_cap": "baseline_cap",
    "alpha": "alpha",
    "delta": "delta",
    "delta_step": "delta_step",
    "cross_clip": "cross_clip",
    "cross_ratio_length": "cross_ratio_length",
}


def test_core_keyword_defaults_are_the_declared_defaults():
    seen = set()
    for name in core_algos.__all__:
        obj = getattr(core_algos, name)
        if not callable(obj):
            continue
        for param in inspect.signature(obj).parameters.values():
            if param.name in CORE_PARAMETERS:
                key = CORE_PARAMETERS[param.name]
                assert param.default == getattr(DEFAULTS, key), f"core_algos.{name}({param.name}=...)"
                seen.add(key)
    assert seen == set(CORE_PARAMETERS.values())


def test_named_cross_clips():
    assert USER_CROSS_CLIPS == ("stepwise", "fixed", "none")
    naive = method_for("naive").effective(HacpoSettings(mode="naive"))
    assert naive.cross_clip == NAIVE_CROSS_CLIP
    # what the driver ships to a Naive actor worker passes the worker's validation
    assert checked_settings(loss_settings(HacpoSettings(mode="naive"))) == naive


# (override, the key it must name); every key has at least one bad value here
BAD = [
    ("algorithm.hacpo.mode=shared", "mode", "must be one of hacpo, naive, isolated, graft, sgt"),
    ("algorithm.hacpo.capability_baseline=maybe", "capability_baseline", "must be true or false"),
    ("algorithm.hacpo.discrepancy_coefficient=2", "discrepancy_coefficient", "must be true or false"),
    ("algorithm.hacpo.alpha=-1", "alpha", "must be >= 0"),
    ("algorithm.hacpo.alpha=abc", "alpha", "must be a number"),
    ("algorithm.hacpo.cross_ratio_length=learner", "cross_ratio_length", "must be one of each, source"),
    ("algorithm.hacpo.cross_clip=clamp", "cross_clip", "must be one of"),
    ("algorithm.hacpo.cross_clip=gspo", "cross_clip", "mode=naive"),
    ("algorithm.hacpo.delta=1.0", "delta", r"must be in \[0, 1\)"),
    ("algorithm.hacpo.delta_step=-0.1", "delta_step", "must be >= 0"),
    ("algorithm.hacpo.window=0", "window", "must be >= 1"),
    ("algorithm.hacpo.window=2.5", "window", "must be a whole number"),
    ("algorithm.hacpo.capability_floor=0", "capability_floor", "must be > 0"),
    ("algorithm.hacpo.omega_clip=[2.0,10.0]", "omega_clip", "0 < ω_min <= 1 <= ω_max"),
    ("algorithm.hacpo.omega_clip=[0.5]", "omega_clip", "two numbers"),
    ("algorithm.hacpo.norm_by_std=yes", "norm_by_std", "must be true or false"),
    ("algorithm.hacpo.baseline_cap=inf", "baseline_cap", "must be a finite number"),
    ("algorithm.hacpo.share_selection=graft", "share_selection", "must be one of all, complementary"),
    ("algorithm.hacpo.graft_balance=1", "graft_balance", "must be true or false"),
    ("algorithm.hacpo.graft_weight=no_gate", "graft_weight", "must be true or false"),
    ("algorithm.hacpo.graft_floor=1.0", "graft_floor", r"must be in \[0, 1\) or null"),
    ("algorithm.hacpo.graft_ratio=seq", "graft_ratio", "must be one of token, sequence"),
    ("algorithm.hacpo.graft_order=random", "graft_order", "must be one of last, first, uniform"),
    ("algorithm.hacpo.sgt_lambda=-0.1", "sgt_lambda", "must be a finite number >= 0"),
    ("algorithm.hacpo.replay_peer=/tmp/recorded/a", "replay_peer", "replays a recorded peer for mode=graft"),
    ("algorithm.hacpo.replay_peer=3", "replay_peer", "must be a path or null"),
    ("algorithm.hacpo.method_options=3", "method_options", "must be a map of option names to values"),
    ("+algorithm.hacpo.method_options.temperature=2", "method_options", "mode=hacpo takes no method options"),
    ("+algorithm.hacpo.alhpa=1", "alhpa", "unknown key"),
]


def test_every_key_has_a_bad_value_case():
    assert {key for _, key, _ in BAD} >= set(KEYS)


@pytest.mark.parametrize("override, key, rule", BAD, ids=[b[0] for b in BAD])
def test_bad_value_or_unknown_key_is_one_line_naming_the_key(override, key, rule):
    cfg = _compose("pair_qwen3-1p7b-base_qwen3-4b-base", ["++ray_kwargs.ray_init.num_gpus=8", override])
    with pytest.raises(ConfigError) as err:
        validate(cfg, check_paths=False)
    message = str(err.value)
    assert message.startswith(f"algorithm.hacpo.{key}"), message
    assert re.search(rule, message), message
    assert "\n" not in message


@pytest.mark.parametrize("mode, why", [("isolated", "shares nothing"), ("sgt", "has its own selection")])
def test_complementary_selection_is_refused_where_it_selects_nothing(mode, why):
    cfg = _compose("pair_qwen3-1p7b-base_qwen3-4b-base", [
        "++ray_kwargs.ray_init.num_gpus=8", f"algorithm.hacpo.mode={mode}", "algorithm.hacpo.share_selection=complementary",
    ])
    with pytest.raises(ConfigError) as err:
        validate(cfg, check_paths=False)
    message = str(err.value)
    assert message.startswith("algorithm.hacpo.share_selection='complementary': must be all"), message
    assert f"mode={mode}" in message and why in message and "\n" not in message


@pytest.mark.parametrize("mode, selects", [("hacpo", True), ("naive", True), ("graft", False)])
def test_complementary_selection_switches_hacpo_and_naive_and_graft_implies_it(mode, selects):
    both = {"mode": mode, "share_selection": "complementary"}
    settings = checked_settings(both)
    method = method_for(mode)
    # graft always selects by its own G1 (graft_exchange); the switch is for the sharing modes
    assert method.selects_complementary(settings) is selects
    assert checked_settings({"mode": mode}).share_selection == "all"
    assert not method.selects_complementary(checked_settings({"mode": mode}))
    # what the driver ships to the actor workers passes their validation
    assert checked_settings(loss_settings(settings)).share_selection == "complementary"


def test_main_reports_a_bad_key_in_one_line_before_ray():
    proc = subprocess.run(
        [sys.executable, "-m", "recipe_hacpo.main", "--config-name", "hacpo_cpu_demo", "algorithm.hacpo.alpha=-1"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: algorithm.hacpo.alpha=-1.0: must be >= 0 (0 turns §4 off)"], proc.stderr[-2000:]
