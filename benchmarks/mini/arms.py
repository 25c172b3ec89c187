"""The compared methods: main arms and ablations, as trainer settings.

Two families, each compared with its own doubling: the GSPO family (isolated GSPO at G, 2G, 4G;
HACPO and Naive sharing, whose update is GSPO's sequence-level loss) and the GRPO family (isolated
GRPO at G, 2G, 4G; GRAFT and SGT, whose updates are GRPO's token-level PPO-clip loss). A family's
`base` arm (G) and `double` arm (2G) are what an arm's Δ and recovered fraction are measured
against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# verl's token-level PPO-clip loss as GRAFT's paper runs GRPO (configs/baseline/grpo.yaml)
GRPO_ACTOR = (
    ("actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla"),
    ("actor_rollout_ref.actor.loss_agg_mode", "token-mean"),
    ("actor_rollout_ref.actor.clip_ratio_low", 0.2),
    ("actor_rollout_ref.actor.clip_ratio_high", 0.28),
)
# GRAFT's and SGT's own losses are token-mean whatever loss_agg_mode says; only the clip is theirs
GRAFT_ACTOR = GRPO_ACTOR[2:]


@dataclass(frozen=True)
class Arm:
    mode: str
    group_mult: int = 1
    hacpo: dict = field(default_factory=dict)
    label: str = ""
    family: str = "gspo"  # the family whose isolated arms this arm is compared with (FAMILIES)
    actor: tuple = ()  # (key, value) trainer overrides beyond hacpo_cpu_demo's GSPO actor


@dataclass(frozen=True)
class Family:
    label: str  # the loss, as the tables name it
    base: str  # isolated at G
    double: str  # isolated at 2G


FAMILIES = {
    "gspo": Family("GSPO", "gspo", "gspo2x"),
    "grpo": Family("GRPO", "grpo", "grpo2x"),
}

ARMS = {
    "gspo": Arm("isolated", 1, label="GSPO (G)"),
    "gspo2x": Arm("isolated", 2, label="GSPO×2 (2G)"),
    "naive": Arm("naive", 1, label="Naive sharing (G each)"),
    "hacpo": Arm("hacpo", 1, label="HACPO (G each)"),
}

# GRAFT's comparison (issue: HACRL beyond HACPO): both families side by side, each with 4G
FAMILY_ARMS = {
    "gspo": ARMS["gspo"],
    "gspo2x": ARMS["gspo2x"],
    "gspo4x": Arm("isolated", 4, label="GSPO×4 (4G)"),
    "naive": ARMS["naive"],
    "hacpo": ARMS["hacpo"],
    "hacpo_graft_sel": Arm("hacpo", 1, {"share_selection": "complementary"}, "HACPO on GRAFT's selection (G each)"),
    "grpo": Arm("isolated", 1, label="GRPO (G)", family="grpo", actor=GRPO_ACTOR),
    "grpo2x": Arm("isolated", 2, label="GRPO×2 (2G)", family="grpo", actor=GRPO_ACTOR),
    "grpo4x": Arm("isolated", 4, label="GRPO×4 (4G)", family="grpo", actor=GRPO_ACTOR),
    "graft": Arm("graft", 1, label="GRAFT (G each)", family="grpo", actor=GRAFT_ACTOR),
    "sgt": Arm("sgt", 1, label="SGT (G each)", family="grpo", actor=GRAFT_ACTOR),
}

ABLATIONS = {
    "abl_no_cap_baseline": Arm("hacpo", 1, {"capability_baseline": False}, "HACPO − capability baseline"),
    "abl_no_discrepancy": Arm("hacpo", 1, {"discrepancy_coefficient": False}, "HACPO − discrepancy coefficient"),
    "abl_alpha0": Arm("hacpo", 1, {"alpha": 0.0}, "HACPO, α = 0"),
    "abl_clip_fixed": Arm("hacpo", 1, {"cross_clip": "fixed"}, "HACPO, cross clip fixed"),
    "abl_clip_none": Arm("hacpo", 1, {"cross_clip": "none"}, "HACPO, no cross clip"),
    "abl_no_guard": Arm("hacpo", 1, {"baseline_cap": "null"}, "HACPO − baseline guard"),
}

# agents that do not wait for each other (trainer.async.*), on the virtual clock: the pair's llama
# agent takes 3 virtual seconds a step, the other 1; both step on until the llama agent made the
# run's steps (benchmarks/async_learning.py)
ASYNC_1TO3 = (("trainer.async.enable", "true"), ("trainer.async.clock", "virtual"),
              ("+trainer.async.virtual_step_s.llama_pair", 3.0), ("trainer.async.stop", "slowest"))
ASYNC_ARMS = {
    "hacpo_async3": Arm("hacpo", 1, label="HACPO, asynchronous at 1 : 3 (G each)", actor=ASYNC_1TO3),
    "naive_async3": Arm("naive", 1, label="Naive sharing, asynchronous at 1 : 3 (G each)", actor=ASYNC_1TO3),
}

ALL_ARMS = {**FAMILY_ARMS, **ABLATIONS, **ASYNC_ARMS}


def reference_arms() -> set[str]:
    """The isolated arms: what sharing arms are measured against, never given a recovered fraction."""
    return {k for k, a in ALL_ARMS.items() if a.mode == "isolated"}
