"""The benchmark's statistics and report, on hand-made run summaries (no trainer run): paired
differences, the regime test, the recovered fraction with its bootstrap interval, and the
report's tables and per-step sharing diagnostics."""

from __future__ import annotations

import math
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from mini import report  # noqa: E402
from mini.agents import AGENTS, PAIRS  # noqa: E402
from mini.runs import Setup, diagnostics  # noqa: E402
from mini.stats import paired, recovered_fraction, regime_holds  # noqa: E402


def test_paired_difference_uses_common_seeds_only():
    d = paired({0: 0.50, 1: 0.60, 2: 0.70, 3: None}, {0: 0.40, 1: 0.45, 3: 0.1})
    assert d.seeds == (0, 1)
    assert d.diffs == pytest.approx((0.10, 0.15))
    assert d.mean == pytest.approx(0.125)
    assert d.std == pytest.approx(math.sqrt(((0.025) ** 2 * 2) / 1))
    assert d.sigmas() == pytest.approx(0.125 / d.std)


def test_regime_needs_three_standard_deviations():
    # gains 4, 5, 6 points: mean 5, std 1 -> 5 sigma
    assert regime_holds(paired({0: 0.54, 1: 0.55, 2: 0.56}, {0: 0.5, 1: 0.5, 2: 0.5}))
    # gains 1, 5, 9 points: mean 5, std 4 -> 1.25 sigma (though 1.25 × √3 = 2.2 standard errors)
    wide = paired({0: 0.51, 1: 0.55, 2: 0.59}, {0: 0.5, 1: 0.5, 2: 0.5})
    assert not regime_holds(wide)
    assert wide.standard_errors() == pytest.approx(1.25 * 3 ** 0.5)
    # a single seed has no spread to compare against
    assert not regime_holds(paired({0: 0.9}, {0: 0.5}))
    # a consistent loss is not a regime where doubling helps
    assert not regime_holds(paired({0: 0.44, 1: 0.45, 2: 0.46}, {0: 0.5, 1: 0.5, 2: 0.5}))


def test_recovered_fraction_is_a_ratio_of_seed_means():
    gspo = {0: 0.50, 1: 0.50, 2: 0.50}
    gspo2x = {0: 0.54, 1: 0.56, 2: 0.58}  # gains 4, 6, 8 -> mean 6
    arm = {0: 0.53, 1: 0.53, 2: 0.53}  # gains 3, 3, 3 -> mean 3
    r = recovered_fraction(arm, gspo, gspo2x, samples=2000)
    assert r.value == pytest.approx(0.5)
    assert r.seeds == (0, 1, 2)
    # the resampled ratios lie between 3/8 and 3/4 (one seed's gain repeated three times), and the
    # interval brackets the point estimate
    assert 3 / 8 - 1e-9 <= r.low <= r.value <= r.high <= 3 / 4 + 1e-9
    assert r.low < r.high
    assert r.undefined == 0.0
    # fixed bootstrap seed: the same runs give the same interval
    assert recovered_fraction(arm, gspo, gspo2x, samples=2000) == r


def test_recovered_fraction_undefined_without_a_gain_or_seeds():
    assert recovered_fraction({0: 0.6, 1: 0.6}, {0: 0.5, 1: 0.5}, {0: 0.5, 1: 0.49}) is None  # no gain to recover
    assert recovered_fraction({0: 0.6}, {0: 0.5}, {0: 0.55}) is None  # one seed
    # one seed where doubling lost: some resamples have no gain; their share is reported
    r = recovered_fraction({0: 0.55, 1: 0.55}, {0: 0.5, 1: 0.5}, {0: 0.6, 1: 0.48}, samples=4000)
    assert r.value == pytest.approx(0.05 / 0.04)
    assert 0.2 < r.undefined < 0.3  # both picks of seed 1: probability 1/4


def _run(arm: str, seed: int, acc: dict[str, float], diag: dict | None = None, steps: int = 4,
         pair: str = "model") -> dict:
    names = list(acc)
    return {
        "arm": arm, "seed": seed, "pair": pair, "names": names, "steps": steps,
        "agents": [AGENTS[k].run_id for k in PAIRS[pair]],
        "train_reward": {n: [0.2] * steps for n in names},
        "val": {n: {str(steps): acc[n]} for n in names},
        "final_acc": acc, "rollout_tokens": {n: 100.0 for n in names}, "timing": {}, "wall_s": 10.0,
        "diagnostics": diag or {n: {} for n in names},
    }


def test_report_has_regime_recovered_fraction_and_diagnostics(tmp_path):
    names = [AGENTS[k].name for k in PAIRS["model"]]
    q, l = names
    steps = {1: {f"agent/{q}/omega/{l}": 0.5, f"agent/{q}/hacpo/cross_clipfrac_low": 0.6,
                 f"agent/{q}/hacpo/cross_clipfrac_high": 0.1, f"agent/{q}/reward/mean": 0.3,
                 f"agent/{l}/hacpo/cross_clipfrac_low": 0.2, f"agent/{l}/hacpo/cross_clipfrac_high": 0.2},
             2: {f"agent/{q}/omega/{l}": 0.7, f"agent/{q}/hacpo/cross_clipfrac_low": 0.4,
                 f"agent/{q}/hacpo/cross_clipfrac_high": 0.1,
                 f"agent/{l}/hacpo/cross_clipfrac_low": 0.2, f"agent/{l}/hacpo/cross_clipfrac_high": 0.2}}
    diag = diagnostics(steps, names)
    assert diag[q]["omega/" + l] == [0.5, 0.7]
    assert "reward/mean" not in diag[q]
    runs = []
    for seed, (g, g2, h) in enumerate([(0.50, 0.54, 0.53), (0.50, 0.56, 0.53), (0.50, 0.58, 0.53)]):
        runs += [_run("gspo", seed, {q: g, l: 0.2}), _run("gspo2x", seed, {q: g2, l: 0.2 + 0.01 * (seed + 1)}),
                 _run("hacpo", seed, {q: h, l: 0.2}, diag)]
    agents = {k: {"agent": AGENTS[k], "record": {"params": 1, "steps": 1, "seed": 0, "held_out_accuracy": 0.5}}
              for k in PAIRS["model"]}
    path = tmp_path / "report.md"
    report.write_report(str(path), runs, agents, Setup(4, 16, 2, 1e-4, 1.0, 4, 64, 64, 2), "cmd", [0, 1, 2],
                        [], 0.0, "model", reading="Sharing helped here.")
    text = path.read_text()
    # regime: qwen gains 4, 6, 8 (3 sigma), llama gains 1, 2, 3 (2 sigma)
    assert f"| {q} | 50.0 ± 0.0 | 56.0 ± 2.0 | +6.0 ± 2.0 (n=3) | s0 +4.0, s1 +6.0, s2 +8.0 | 3.0 | yes | 5.2 |" in text
    assert f"| {l} | 20.0 ± 0.0 | 22.0 ± 1.0 | +2.0 ± 1.0 (n=3) | s0 +1.0, s1 +2.0, s2 +3.0 | 2.0 | no | 3.5 |" in text
    assert "does **not** clear the bar" in text
    hacpo_row = next(line for line in text.splitlines() if line.startswith("| HACPO (G each) | 0,1,2 |"))
    assert "+3.0 ± 0.0 (n=3)" in hacpo_row and "0.50 [" in hacpo_row
    # diagnostics: ω mean 0.6; qwen's cross rows carried gradient 1 - 0.5 - 0.1 = 40 %, llama's 60 %
    assert f"| HACPO (G each) | {q} | — | 0.600 | — | 0.500 | 0.100 | — | — | 40% | 40% |" in text
    assert f"| HACPO (G each) | {l} | — | — | — | 0.200 | 0.200 | — | — | 60% | 60% |" in text
    assert "## Reading\n\nSharing helped here." in text


def test_report_pairs_each_ablation_with_hacpo_of_the_same_seed(tmp_path):
    q, l = (AGENTS[k].name for k in PAIRS["model"])
    runs = []
    # HACPO's seeds differ by 10 points; the guard ablation moves qwen by +1, +2, +3 on top of that
    # (paired: +2 ± 1) and llama by -9 on every seed; seed 2 of the fixed-clip ablation did not run
    for seed, (h_q, h_l) in enumerate([(0.30, 0.60), (0.40, 0.70), (0.50, 0.80)]):
        runs += [_run("gspo", seed, {q: 0.2, l: 0.5}), _run("gspo2x", seed, {q: 0.3, l: 0.6}),
                 _run("hacpo", seed, {q: h_q, l: h_l}),
                 _run("abl_no_guard", seed, {q: h_q + 0.01 * (seed + 1), l: h_l - 0.09})]
        if seed < 2:
            runs.append(_run("abl_clip_fixed", seed, {q: h_q, l: h_l + 0.02}))
    agents = {k: {"agent": AGENTS[k], "record": {"params": 1, "steps": 1, "seed": 0, "held_out_accuracy": 0.5}}
              for k in PAIRS["model"]}
    path = tmp_path / "report.md"
    report.write_report(str(path), runs, agents, Setup(4, 16, 2, 1e-4, 1.0, 4, 64, 64, 2), "cmd", [0, 1, 2],
                        [], 0.0, "model")
    text = path.read_text()
    assert f"| HACPO − baseline guard | {q} | +2.0 ± 1.0 (n=3) | s0 +1.0, s1 +2.0, s2 +3.0 | 2.0 |" in text
    assert f"| HACPO − baseline guard | {l} | -9.0 ± 0.0 (n=3) | s0 -9.0, s1 -9.0, s2 -9.0 | -inf |" in text
    assert f"| HACPO, cross clip fixed | {l} | +2.0 ± 0.0 (n=2) | s0 +2.0, s1 +2.0 | inf |" in text
    # ablations the run did not make get no row
    assert "| HACPO, α = 0 |" not in text
    assert text.count("Each ablation against HACPO of the same seeds") == 1
    # without HACPO's own runs there is nothing to pair with: neither the table nor its heading
    report.write_report(str(path), [r for r in runs if r["arm"] != "hacpo"], agents,
                        Setup(4, 16, 2, 1e-4, 1.0, 4, 64, 64, 2), "cmd", [0, 1, 2], [], 0.0, "model")
    text = path.read_text()
    assert "| HACPO − baseline guard | 0,1,2 |" in text
    assert "Each ablation against HACPO" not in text and "ablation − HACPO" not in text


def test_step_zero_accuracy_is_shared_by_every_run_of_the_same_warm_start_and_held_out_rows(tmp_path):
    from mini.runs import step_zero_accuracy

    weak, strong = PAIRS["model"]
    q, l = AGENTS[weak].name, AGENTS[strong].name
    # only the first run of an invocation validated at step 0: a `state` run (the weak agent with
    # another peer), scored on 4096 held-out rows
    state_peer = AGENTS[PAIRS["state"][1]].name
    first = _run("gspo", 0, {q: 0.2, state_peer: 0.6}, pair="state")
    first.update(val_rows=4096, machine="machine A")
    first["val"][q]["0"], first["val"][state_peer]["0"] = 0.13, 0.27
    later = [_run(arm, 0, {q: 0.2, l: 0.5}) for arm in ("gspo", "gspo2x")]
    for r in later:
        r.update(val_rows=4096, machine="machine B")
    unscored = _run("gspo", 1, {q: 0.2, l: 0.5})  # recorded before val_rows: the shipped 1024 rows
    runs = [first, *later, unscored]
    assert step_zero_accuracy(runs, later[1], q) == 0.13
    assert step_zero_accuracy(runs, unscored, q) is None  # other held-out rows
    assert step_zero_accuracy(runs, later[1], l) is None  # never validated at step 0
    agents = {k: {"agent": AGENTS[k], "record": {"params": 1, "steps": 1, "seed": 0, "held_out_accuracy": 0.5}}
              for k in {*PAIRS["model"], *PAIRS["state"]}}
    path = tmp_path / "report.md"
    report.write_report(str(path), later, agents, Setup(4, 16, 2, 1e-4, 1.0, 4, 4096, 64, 2), "cmd", [0],
                        [], 0.0, "model")
    text = path.read_text()
    assert "Held-out accuracy at step 0" not in text  # the report only has the later runs
    report.write_report(str(path), runs[:3], agents, Setup(4, 16, 2, 1e-4, 1.0, 4, 4096, 64, 2), "cmd", [0],
                        [], 0.0, "model")
    text = path.read_text()
    assert (f"Held-out accuracy at step 0 measured by the trainer's validation: {q} 13.0 %; "
            f"{l} not validated at step 0 by any run.") in text
    # the machines the runs were made on, not the one that rebuilt the report
    assert "Runs made on: machine A (1 runs); machine B (2 runs). Report written on: " in text


def test_every_arm_updates_on_the_same_number_of_rows():
    from mini.arms import ALL_ARMS
    from mini.runs import mini_batch_prompts

    setup = Setup(40, 32, 2, 1e-4, 1.0, 20, 64, 512, 4)
    prompts = {k: mini_batch_prompts(ALL_ARMS[k], setup, 2) for k in ("gspo", "gspo2x", "naive", "hacpo")}
    # 32 rows an update: GSPO 16 prompts × 2 (2 updates), GSPO×2 8 × 4, sharing 8 × (2 own + 2 cross) (4 updates)
    assert prompts == {"gspo": 16, "gspo2x": 8, "naive": 8, "hacpo": 8}
    one = Setup(40, 32, 2, 1e-4, 1.0, 20, 64, 512, 1)
    # one sharing update a step would need GSPO to update on two steps' prompts: capped at one update a step
    assert mini_batch_prompts(ALL_ARMS["gspo"], one, 2) == 32


def test_regime_search_groups_runs_by_setting_and_collects_work_folders(tmp_path):
    import json

    import regime_search

    def run(arm, seed, group, lr, acc):
        out = _run(arm, seed, acc)
        out.update(group=group, lr=lr, agents=["a_dir", "b_dir"], prompts=32, temperature=1.0, mini_batches=4,
                   timing={"gen": [0.1]}, diagnostics={})
        return out

    runs = []
    for seed, (x, y) in enumerate([(0.04, 0.05), (0.05, 0.06), (0.06, 0.07)]):
        # lr 1e-4: a gains 4, 5, 6 points (5 std), b gains 5, 6, 7 (6 std); lr 3e-5: b gains 1, 5, 9 (1.25 std)
        runs += [run("gspo", seed, 2, 1e-4, {"a": 0.5, "b": 0.2}), run("gspo2x", seed, 4, 1e-4, {"a": 0.5 + x, "b": 0.2 + y})]
        runs += [run("gspo", seed, 2, 3e-5, {"a": 0.5, "b": 0.2}),
                 run("gspo2x", seed, 4, 3e-5, {"a": 0.5 + x, "b": 0.2 + 0.01 + 0.04 * seed})]
    runs.append(run("hacpo", 0, 2, 1e-4, {"a": 0.9, "b": 0.9}))  # not a regime arm
    text = regime_search.report([r for r in runs if r["arm"] in regime_search.REGIME_ARMS])
    rows = [line for line in text.splitlines() if line.startswith("| a_dir + b_dir: G = 2")]
    assert rows == [
        "| a_dir + b_dir: G = 2 against 2G = 4, lr 3e-05, 4 steps, 32 prompts a step, temperature 1, `--mini-batches 4` | 3 | no |",
        "| a_dir + b_dir: G = 2 against 2G = 4, lr 0.0001, 4 steps, 32 prompts a step, temperature 1, `--mini-batches 4` | 3 | yes |",
    ]
    assert "| b | 20.0 ± 0.0 | 26.0 ± 1.0 | +6.0 ± 1.0 (n=3) | s0 +5.0, s1 +6.0, s2 +7.0 | 6.0 | yes | 10.4 |" in text

    # collect: a work folder's GSPO / GSPO×2 summaries join the file once, without timings
    for r in runs:
        d = tmp_path / "work" / "runs" / f"{r['arm']}_{r['seed']}_{r['lr']}"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps(r))
    into = tmp_path / "regime_runs.json"
    assert regime_search.collect([str(tmp_path / "work")], str(into)) == 12
    assert regime_search.collect([str(tmp_path / "work")], str(into)) == 0
    kept = json.loads(into.read_text())
    assert len(kept) == 12 and all("timing" not in r and r["arm"] != "hacpo" for r in kept)


def test_an_agent_with_its_own_lr_is_trained_and_cached_apart():
    import dataclasses

    from mini.arms import ALL_ARMS
    from mini.runs import _stale, run_overrides

    setup = Setup(20, 64, 2, 1e-4, 1.0, 10, 1024, 512, 4)
    own = dataclasses.replace(AGENTS["M12"], lr=3e-4)
    agents = [{"agent": own, "path": "/a"}, {"agent": AGENTS["B"], "path": "/b"}]
    spec = next(o for o in run_overrides(ALL_ARMS["gspo"], 0, agents, setup, "/tmp/r", True) if o.startswith("+agents="))
    # the agent's lr goes into its own actor_rollout_ref block; the other agent keeps the benchmark's
    assert f"{own.name}:{{model_path:'/a',rollout_n:2,n_gpus_per_node:1,nnodes:1,actor_rollout_ref:{{actor:{{optim:{{lr:0.0003}}}}}}}}" in spec
    assert f"{AGENTS['B'].name}:{{model_path:'/b',rollout_n:2,n_gpus_per_node:1,nnodes:1,actor_rollout_ref:{{}}}}" in spec
    assert own.run_id == AGENTS["M12"].dirname + "@lr0.0003" and AGENTS["B"].run_id == AGENTS["B"].dirname
    # a run made without the agent's own lr is not reused for one with it
    made = {"steps": 20, "group": 2, "prompts": 64, "lr": 1e-4, "temperature": 1.0, "mini_batches": 4,
            "mini_batch_rule": "equal_rows", "agents": [AGENTS["M12"].run_id, AGENTS["B"].run_id]}
    assert _stale(made, ALL_ARMS["gspo"], setup, [own.run_id, AGENTS["B"].run_id]).startswith("agents ")
    assert _stale(made, ALL_ARMS["gspo"], setup, [AGENTS["M12"].run_id, AGENTS["B"].run_id]) == ""
    # nor one scored on fewer held-out prompts (runs recorded before the key: the shipped 1024)
    assert _stale(made, ALL_ARMS["gspo"], dataclasses.replace(setup, val_rows=4096),
                  [AGENTS["M12"].run_id, AGENTS["B"].run_id]) == "val_rows 1024 != 4096"


def test_more_held_out_rows_extend_the_shipped_draw(tmp_path):
    import pyarrow.parquet as pq

    from mini.common import VAL_FILE
    from mini.runs import held_out_file

    assert held_out_file(str(tmp_path), 1024) == VAL_FILE and held_out_file(str(tmp_path), 16) == VAL_FILE
    path = held_out_file(str(tmp_path), 1500)
    rows = pq.read_table(path).to_pylist()
    shipped = pq.read_table(VAL_FILE).to_pylist()
    assert len(rows) == 1500 and rows[:1024] == shipped
    assert len({r["prompt"][0]["content"] for r in rows}) == 1500
    assert held_out_file(str(tmp_path), 1500) == path  # written once


def test_a_cosine_learning_rate_is_passed_to_verl_recorded_and_kept_apart():
    import dataclasses

    import regime_search
    from mini.arms import ALL_ARMS
    from mini.runs import _stale, run_overrides

    setup = Setup(20, 64, 2, 1e-4, 1.0, 10, 1024, 512, 4)
    cosine = dataclasses.replace(setup, lr_schedule="cosine")
    agents = [{"agent": AGENTS["M12"], "path": "/a"}, {"agent": AGENTS["B"], "path": "/b"}]
    assert "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine" in run_overrides(
        ALL_ARMS["gspo"], 0, agents, cosine, "/tmp/r", True)
    assert "actor_rollout_ref.actor.optim.lr_scheduler_type=constant" in run_overrides(
        ALL_ARMS["gspo"], 0, agents, setup, "/tmp/r", True)
    # a run recorded before the key made its steps at a constant lr: reused for constant, not for cosine
    made = {"steps": 20, "group": 2, "prompts": 64, "lr": 1e-4, "temperature": 1.0, "mini_batches": 4,
            "mini_batch_rule": "equal_rows"}
    assert _stale(made, ALL_ARMS["gspo"], setup) == ""
    assert _stale(made, ALL_ARMS["gspo"], cosine) == "lr_schedule constant != cosine"
    assert _stale({**made, "lr_schedule": "cosine"}, ALL_ARMS["gspo"], cosine) == ""

    def run(arm, seed, group, schedule, acc):
        out = _run(arm, seed, acc)
        out.update(group=group, lr=1e-4, agents=["a_dir", "b_dir"], prompts=32, temperature=1.0, mini_batches=4,
                   timing={}, diagnostics={})
        if schedule:
            out["lr_schedule"] = schedule
        return out

    runs = [run(arm, seed, g, schedule, {"a": 0.5, "b": 0.2})
            for schedule in (None, "cosine") for seed in range(2) for arm, g in (("gspo", 2), ("gspo2x", 4))]
    rows = [line for line in regime_search.report(runs).splitlines() if line.startswith("| a_dir + b_dir: G = 2")]
    assert rows == [
        "| a_dir + b_dir: G = 2 against 2G = 4, lr 0.0001, 4 steps, 32 prompts a step, temperature 1, `--mini-batches 4` | 2 | no |",
        "| a_dir + b_dir: G = 2 against 2G = 4, lr 0.0001 (cosine decay to 0), 4 steps, 32 prompts a step, temperature 1, `--mini-batches 4` | 2 | no |",
    ]


def test_both_families_are_measured_against_their_own_doubling(tmp_path):
    """GRAFT and SGT against GRPO / GRPO×2, HACPO against GSPO / GSPO×2, in one report: Δ, recovered
    fraction and regime test per family, head to head, the exchange tables and each arm's update plan."""
    from mini.arms import FAMILY_ARMS

    names = [AGENTS[k].name for k in PAIRS["model"]]
    q, l = names
    graft_diag = {n: {"graft/groups_received": [4.0, 6.0], "graft/groups_given": [1.0, 1.0],
                      "graft/admitted": [3.0, 5.0], "graft/dropped": [1.0, float("nan")],
                      "graft/weight_mean": [0.9, 0.95]} for n in names}
    sgt_diag = {n: {"sgt/prompts_imitated": [2.0, 4.0], "sgt/nll": [1.5, 0.5]} for n in names}
    sel_diag = {n: {"cross/groups_selected": [3.0, 5.0], "cross/rows_selected": [6.0, 10.0]} for n in names}
    accs = {  # per seed: the GSPO family gains 10 points by doubling, the GRPO family 4, 6, 8
        "gspo": [0.50] * 3, "gspo2x": [0.60] * 3, "gspo4x": [0.65] * 3, "naive": [0.56] * 3, "hacpo": [0.52] * 3,
        "hacpo_graft_sel": [0.51] * 3, "grpo": [0.30] * 3, "grpo2x": [0.34, 0.36, 0.38], "grpo4x": [0.40] * 3,
        "graft": [0.33] * 3, "sgt": [0.30, 0.31, 0.32],
    }
    diag = {"graft": graft_diag, "sgt": sgt_diag, "hacpo_graft_sel": sel_diag}
    runs = [_run(arm, seed, {q: acc[i], l: 0.2}, diag.get(arm)) for arm, acc in accs.items()
            for i, seed in enumerate((5, 6, 7))]
    agents = {k: {"agent": AGENTS[k], "record": {"params": 1, "steps": 1, "seed": 0, "held_out_accuracy": 0.5}}
              for k in PAIRS["model"]}
    path = tmp_path / "report.md"
    report.write_report(str(path), runs, agents, Setup(4, 16, 2, 1e-4, 1.0, 4, 64, 64, 2), "cmd", [5, 6, 7],
                        [], 0.0, "model", main_arms=list(FAMILY_ARMS))
    text = path.read_text()
    row = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ") and " | 5,6,7 | " in line}
    # GRAFT: +3 over GRPO, half of GRPO×2's mean gain of 6; HACPO: +2 over GSPO, a fifth of GSPO×2's 10
    assert "| 33.0 ± 0.0 | +3.0 ± 0.0 (n=3) | 0.50 [" in row["GRAFT (G each)"]
    assert "| 52.0 ± 0.0 | +2.0 ± 0.0 (n=3) | 0.20 [" in row["HACPO (G each)"]
    assert "| 31.0 ± 1.0 | +1.0 ± 1.0 (n=3) | 0.17 [" in row["SGT (G each)"]
    assert "| 40.0 ± 0.0 | +10.0 ± 0.0 (n=3) | 1.67 [" in row["GRPO×4 (4G)"]  # 4G against doubling's gain
    assert "| 60.0 ± 0.0 | +10.0 ± 0.0 (n=3) | — |" in row["GSPO×2 (2G)"]
    assert "| 30.0 ± 0.0 | — | — |" in row["GRPO (G)"]
    # a regime test per family
    assert "| agent | GRPO acc % | GRPO×2 acc % | GRPO×2 − GRPO (points, paired) |" in text
    assert f"| {q} | 30.0 ± 0.0 | 36.0 ± 2.0 | +6.0 ± 2.0 (n=3) | s5 +4.0, s6 +6.0, s7 +8.0 | 3.0 | yes | 5.2 |" in text
    assert f"| {q} | 50.0 ± 0.0 | 60.0 ± 0.0 | +10.0 ± 0.0 (n=3) |" in text
    # head to head, paired by seed
    assert f"| GRAFT (G each) | HACPO (G each) | {q} | -19.0 ± 0.0 (n=3) | s5 -19.0, s6 -19.0, s7 -19.0 |" in text
    assert f"| GRAFT (G each) | GRPO×2 (2G) | {q} | -3.0 ± 2.0 (n=3) | s5 -1.0, s6 -3.0, s7 -5.0 | -1.5 |" in text
    # exchange tables: per-step means over the steps that logged the metric
    assert f"| GRAFT (G each) | {q} | 5.000 | 1.000 | 4.000 | 1.000 | 0.925 | — |" in text
    assert f"| SGT (G each) | {l} | 3.000 | — | 1.000 |" in text
    assert f"| HACPO on GRAFT's selection (G each) | {q} | 4.000 | 8.000 | — |" in text
    # the update plan: every update holds 16 // 2 × 2 × 2 = 32 trained rows
    assert "| GSPO×4 (4G) | GSPO | 8 | 8 | 4 | 4 | 32 |" in text
    assert "| GRAFT (G each) | GRAFT (token-level, w, receiver's ratio) | 2 | 2 | 16 | 1 | 32 |" in text
    assert "| SGT (G each) | GRPO + 0.1·NLL | 2 | 2 + 1 imitated | 16 | 1 | 32 |" in text
    assert "| HACPO (G each) | HACPO (GSPO-based) | 2 | 4 | 8 | 2 | 32 |" in text


def test_the_grpo_family_arms_carry_their_loss_and_sgt_micro_batches_split_its_imitation_slot():
    from mini.arms import ALL_ARMS
    from mini.runs import run_overrides

    setup = Setup(20, 128, 2, 1e-4, 1.0, 10, 4096, 512, 4)
    agents = [{"agent": AGENTS["M18"], "path": "/a"}, {"agent": AGENTS["B"], "path": "/b"}]

    def ov(arm):
        return dict(o.split("=", 1) for o in run_overrides(ALL_ARMS[arm], 5, agents, setup, "/tmp/r", False)
                    if not o.startswith(("~agents", "+agents=")))

    grpo, gspo, graft, sgt = ov("grpo"), ov("gspo"), ov("graft"), ov("sgt")
    assert grpo["actor_rollout_ref.actor.policy_loss.loss_mode"] == "vanilla"
    assert (grpo["actor_rollout_ref.actor.clip_ratio_low"], grpo["actor_rollout_ref.actor.clip_ratio_high"]) == ("0.2", "0.28")
    assert "actor_rollout_ref.actor.policy_loss.loss_mode" not in gspo  # hacpo_cpu_demo's GSPO
    assert graft["algorithm.hacpo.mode"] == "graft" and graft["actor_rollout_ref.actor.clip_ratio_low"] == "0.2"
    assert ov("hacpo_graft_sel")["algorithm.hacpo.share_selection"] == "complementary"
    # 128 rows an update: GRAFT 64 prompts × 2; SGT 64 × (2 own + 1 imitation slot) = 192 rows in its batch
    assert graft["actor_rollout_ref.actor.ppo_mini_batch_size"] == sgt["actor_rollout_ref.actor.ppo_mini_batch_size"] == "64"
    micro = int(sgt["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"])
    assert 192 % micro == 0 and 128 % micro == 0
    assert ov("grpo4x")["actor_rollout_ref.actor.ppo_mini_batch_size"] == "16"
