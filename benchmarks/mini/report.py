"""The benchmark's Markdown reports: the main table, ablations, other pairs, the cost profile."""

from __future__ import annotations

import math
import statistics
import time

from mini.agents import PAIR_KINDS, PAIRS
from mini.arms import ABLATIONS, ALL_ARMS, ARMS, FAMILIES, Family
from mini.common import fmt_pm, machines_line
from mini.runs import Setup, mini_batch_prompts, step_zero_accuracy, trained_rows_per_prompt
from mini.stats import Paired, Recovered, paired, recovered_fraction, regime_holds


def agent_table_header(names: list[str], base: str = "GSPO") -> tuple[str, str]:
    cols = ["arm", "seeds"]
    for n in names:
        cols += [f"{n} acc %", f"{n} Δ vs {base}", f"{n} recovered [90 % CI]"]
    cols += ["mean train reward %", "rollout tokens / run", "wall s / run"]
    return "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)


def acc_at(run: dict, name: str, at_step: int | None):
    """Held-out accuracy after the last step, or after step `at_step` (from the periodic validation)."""
    if at_step is None or at_step == run["steps"]:
        return run["final_acc"][name]
    return run["val"][name].get(str(at_step))


def accs_by_seed(runs: dict[int, dict], name: str, at_step: int | None) -> dict[int, float]:
    return {seed: acc_at(run, name, at_step) for seed, run in runs.items()}


def fmt_paired(d: Paired) -> str:
    if not d.diffs:
        return "—"
    if len(d.diffs) == 1:
        return "%+.1f (n=1)" % (d.mean * 100)
    return "%+.1f ± %.1f (n=%d)" % (d.mean * 100, d.std * 100, len(d.diffs))


def fmt_per_seed(d: Paired) -> str:
    """Each seed's paired difference in points: `s0 +4.0, s1 +6.0`."""
    return ", ".join(f"s{s} {x * 100:+.1f}" for s, x in zip(d.seeds, d.diffs))


def fmt_recovered(r: Recovered | None) -> str:
    if r is None:
        return "—"
    undefined = f", {r.undefined:.0%} of resamples undefined" if r.undefined >= 0.005 else ""
    return f"{r.value:.2f} [{r.low:.2f}, {r.high:.2f}] (n={len(r.seeds)}{undefined})"


def by_arm_and_seed(summaries: list[dict]) -> dict[str, dict[int, dict]]:
    by: dict[str, dict[int, dict]] = {}
    for s in summaries:
        by.setdefault(s["arm"], {})[s["seed"]] = s
    return by


def arm_rows(summaries: list[dict], arm_keys: list[str], names: list[str], at_step: int | None = None) -> list[str]:
    """One table row per arm: accuracy, Δ vs its family's isolated arm at G paired by seed, and the
    recovered fraction against that family's doubling (every arm but the family's G and 2G)."""
    by = by_arm_and_seed(summaries)
    rows = []
    for key in arm_keys:
        runs = by.get(key, {})
        if not runs:
            continue
        family = FAMILIES[ALL_ARMS[key].family]
        gspo, gspo2x = by.get(family.base, {}), by.get(family.double, {})
        seeds = sorted(runs)
        cells = [ALL_ARMS[key].label + (f" (step {at_step} of {runs[seeds[0]]['steps']})"
                                        if at_step and runs[seeds[0]]["steps"] != at_step else ""),
                 ",".join(map(str, seeds))]
        for n in names:
            mine = accs_by_seed(runs, n, at_step)
            cells.append(fmt_pm([v for v in mine.values() if v is not None]))
            cells.append(fmt_paired(paired(mine, accs_by_seed(gspo, n, at_step))) if key != family.base else "—")
            shares = key not in (family.base, family.double)
            cells.append(fmt_recovered(recovered_fraction(mine, accs_by_seed(gspo, n, at_step),
                                                          accs_by_seed(gspo2x, n, at_step))) if shares else "—")
        upto = at_step or None
        auc = [statistics.fmean(statistics.fmean(runs[s]["train_reward"][n][:upto]) for n in names) for s in seeds]
        cells.append(fmt_pm(auc))
        if at_step and runs[seeds[0]]["steps"] != at_step:
            cells += ["—", "—"]
        else:
            toks = [sum(runs[s]["rollout_tokens"].values()) for s in seeds]
            cells.append(f"{statistics.fmean(toks):,.0f}")
            cells.append(f"{statistics.fmean([runs[s]['wall_s'] for s in seeds]):.0f}")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def regime_table(summaries: list[dict], names: list[str], sigmas: float = 3.0,
                 family: Family = FAMILIES["gspo"]) -> tuple[list[str], bool]:
    """The family's 2G − G per agent (GSPO×2 − GSPO by default), paired by seed, and whether it clears
    `sigmas` std on every agent (no lines and False without both arms)."""
    by = by_arm_and_seed(summaries)
    if not by.get(family.base) or not by.get(family.double):
        return [], False
    f = family.label
    lines = [f"| agent | {f} acc % | {f}×2 acc % | {f}×2 − {f} (points, paired) | per seed | mean / std | "
             f"≥ {sigmas:g} std? | mean / s.e. |", "|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for n in names:
        g, g2 = accs_by_seed(by[family.base], n, None), accs_by_seed(by[family.double], n, None)
        d = paired(g2, g)
        holds = regime_holds(d, sigmas)
        verdicts.append(holds)
        lines.append(f"| {n} | {fmt_pm([g[s] for s in d.seeds])} | {fmt_pm([g2[s] for s in d.seeds])} | "
                     f"{fmt_paired(d)} | {fmt_per_seed(d)} | {d.sigmas():.1f} | {'yes' if holds else 'no'} | "
                     f"{d.standard_errors():.1f} |")
    return lines, all(verdicts)


def regime_lines(summaries: list[dict], names: list[str], sigmas: float = 3.0,
                 family: Family = FAMILIES["gspo"]) -> list[str]:
    """Does doubling the rollouts matter here? The regime table and its verdict."""
    table, holds = regime_table(summaries, names, sigmas, family)
    if not table:
        return []
    return [*table, "", "Doubling the rollouts matters for every agent in this regime." if holds else
            "Doubling the rollouts does **not** clear the bar for every agent in this regime: the recovered "
            "fractions below divide by a gain that is not clearly above noise.", ""]


def ablation_vs_hacpo_lines(summaries: list[dict], names: list[str], at_step: int | None = None) -> list[str]:
    """Each ablation against full HACPO, paired by seed: what switching one mechanism off did."""
    by = by_arm_and_seed(summaries)
    hacpo = by.get("hacpo", {})
    present = [key for key in ABLATIONS if by.get(key)]
    if not hacpo or not present:
        return []
    lines = ["Each ablation against HACPO of the same seeds (a positive difference: the agent did better with "
             "the mechanism off):", "",
             "| ablation | agent | ablation − HACPO (points, paired) | per seed | mean / std |", "|---|---|---|---|---|"]
    for key in present:
        for n in names:
            d = paired(accs_by_seed(by[key], n, at_step), accs_by_seed(hacpo, n, at_step))
            lines.append(f"| {ALL_ARMS[key].label} | {n} | {fmt_paired(d)} | {fmt_per_seed(d)} | {d.sigmas():.1f} |")
    return [*lines, ""]


# per-step sharing metrics summarised per arm and agent: (metric, column title)
DIAGNOSTIC_COLUMNS = (
    ("capability", "P̂"),
    ("omega/*", "ω (from peer)"),
    ("hacpo/cross_ratio_mean", "mean s (cross)"),
    ("hacpo/cross_clipfrac_low", "cross s < bound"),
    ("hacpo/cross_clipfrac_high", "cross s > 1"),
    ("advantage/guard_groups", "guard groups / step"),
    ("hacpo/lower_bound", "bound (mean over updates)"),
)


def _run_mean(diag: dict[str, list[float]], metric: str, last: int | None = None) -> float | None:
    keys = [k for k in diag if k.startswith(metric[:-1])] if metric.endswith("*") else [metric]
    vals = [v for k in keys if k in diag for v in diag[k][-last if last else 0:] if not math.isnan(v)]
    return statistics.fmean(vals) if vals else None


def diagnostic_lines(summaries: list[dict], names: list[str], arm_keys: list[str], last: int = 10) -> list[str]:
    """Per sharing arm and agent: the step-averaged sharing metrics (mean over seeds), and the share of
    cross rows that carried gradient over the whole run and over its last `last` steps."""
    by = by_arm_and_seed(summaries)
    head = ["arm", "agent", *[t for _, t in DIAGNOSTIC_COLUMNS], "cross rows with gradient (all steps)",
            f"cross rows with gradient (last {last} steps)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in arm_keys:
        runs = [r for r in by.get(key, {}).values() if r.get("diagnostics")]
        if not runs or ALL_ARMS[key].mode not in ("hacpo", "naive"):
            continue
        for n in names:
            cells = [ALL_ARMS[key].label, n]
            for metric, _ in DIAGNOSTIC_COLUMNS:
                vals = [v for r in runs if (v := _run_mean(r["diagnostics"][n], metric)) is not None]
                cells.append(f"{statistics.fmean(vals):.3f}" if vals else "—")
            for window in (None, last):
                kept = []
                for r in runs:
                    lo = _run_mean(r["diagnostics"][n], "hacpo/cross_clipfrac_low", window)
                    hi = _run_mean(r["diagnostics"][n], "hacpo/cross_clipfrac_high", window)
                    if lo is not None and hi is not None:
                        kept.append(1.0 - lo - hi)
                cells.append(f"{statistics.fmean(kept):.0%}" if kept else "—")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


# per-step exchange metrics of GRAFT, SGT and HACPO on GRAFT's selection (docs/METRICS.md):
# mode or share selection -> (metric, column title), each a per-step value averaged over steps
EXCHANGE_COLUMNS = {
    "graft": (("graft/groups_received", "groups received / step"), ("graft/groups_given", "groups given / step"),
              ("graft/admitted", "grafted responses admitted / step"), ("graft/dropped", "dropped by the gate / step"),
              ("graft/weight_mean", "mean w (admitted)"), ("graft/peer_clipfrac", "peer-token clip fraction")),
    "sgt": (("sgt/prompts_imitated", "prompts imitated / step"), ("sgt/imitation_tokens", "imitated tokens / step"),
            ("sgt/nll", "NLL per imitated token")),
    "complementary": (("cross/groups_selected", "prompts trained on a peer's rows / step"),
                      ("cross/rows_selected", "peer rows in the loss / step"), ("cross/rows", "peer rows in the batch / step")),
}
EXCHANGE_TITLES = {
    "graft": "GRAFT: whole groups grafted where the receiver's own group failed (balanced per pair), and the "
             "compatibility gate w (δ = 0.8)",
    "sgt": "SGT: one correct peer response imitated (λ·NLL) where the receiver failed and a peer solved",
    "complementary": "HACPO on GRAFT's selection: the peer rows HACPO's update keeps",
}


def _exchange_kind(arm_key: str) -> str | None:
    arm = ALL_ARMS[arm_key]
    if arm.mode in ("graft", "sgt"):
        return arm.mode
    if arm.hacpo.get("share_selection") == "complementary":
        return "complementary"
    return None


def exchange_lines(summaries: list[dict], names: list[str], arm_keys: list[str]) -> list[str]:
    """Per exchange kind (GRAFT, SGT, HACPO on GRAFT's selection) a table: per arm and agent, each
    metric averaged over the steps that logged it, then over seeds."""
    by = by_arm_and_seed(summaries)
    lines = []
    for kind, columns in EXCHANGE_COLUMNS.items():
        keys = [k for k in arm_keys if _exchange_kind(k) == kind and by.get(k)]
        if not keys:
            continue
        head = ["arm", "agent", *[t for _, t in columns]]
        lines += [f"{EXCHANGE_TITLES[kind]}:", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for key in keys:
            runs = [r for r in by[key].values() if r.get("diagnostics")]
            for n in names:
                cells = [ALL_ARMS[key].label, n]
                for metric, _ in columns:
                    vals = [v for r in runs if (v := _run_mean(r["diagnostics"][n], metric)) is not None]
                    cells.append(f"{statistics.fmean(vals):.3f}" if vals else "—")
                lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return lines


# the comparisons that settle the question, each A − B paired by seed (shown where both arms ran)
HEAD_TO_HEAD = (
    ("graft", "grpo"), ("graft", "grpo2x"), ("graft", "grpo4x"), ("sgt", "grpo"), ("graft", "sgt"),
    ("hacpo", "gspo"), ("hacpo", "gspo2x"), ("naive", "gspo2x"), ("naive", "hacpo"),
    ("hacpo_graft_sel", "hacpo"), ("graft", "hacpo"), ("graft", "naive"), ("grpo", "gspo"), ("grpo2x", "gspo2x"),
)


def head_to_head_lines(summaries: list[dict], names: list[str], at_step: int | None = None) -> list[str]:
    by = by_arm_and_seed(summaries)
    present = [(a, b) for a, b in HEAD_TO_HEAD if by.get(a) and by.get(b)]
    if not present:
        return []
    lines = ["| A | B | agent | A − B (points, paired) | per seed | mean / std | mean / s.e. |",
             "|---|---|---|---|---|---|---|"]
    for a, b in present:
        for n in names:
            d = paired(accs_by_seed(by[a], n, at_step), accs_by_seed(by[b], n, at_step))
            lines.append(f"| {ALL_ARMS[a].label} | {ALL_ARMS[b].label} | {n} | {fmt_paired(d)} | {fmt_per_seed(d)} | "
                         f"{d.sigmas():.1f} | {d.standard_errors():.1f} |")
    return [*lines, ""]


def update_plan_lines(arm_keys: list[str], setup: Setup, n_agents: int) -> list[str]:
    """What each arm samples and how it updates, computed by the same rule the runs use."""
    lines = ["| arm | loss | rollouts per prompt and agent | learner rows per prompt | prompts per update | "
             "updates per step | rows per update |", "|---|---|---|---|---|---|---|"]
    for key in arm_keys:
        arm = ALL_ARMS[key]
        g = setup.group * (arm.group_mult if arm.mode == "isolated" else 1)
        rows = trained_rows_per_prompt(arm, setup, n_agents)
        mini = mini_batch_prompts(arm, setup, n_agents)
        loss = {"graft": "GRAFT (token-level, w, receiver's ratio)", "sgt": "GRPO + 0.1·NLL",
                "hacpo": "HACPO (GSPO-based)", "naive": "GSPO over own + peer rows"}.get(arm.mode, FAMILIES[arm.family].label)
        lines.append(f"| {arm.label} | {loss} | {g} | {rows}{' + 1 imitated' if arm.mode == 'sgt' else ''} | {mini} | "
                     f"{setup.prompts // mini} | {mini * rows} |")
    return [*lines, ""]


def agent_lines(agents: dict, keys: tuple[str, ...]) -> list[str]:
    lines = ["| key | trainer name | kind | params | warm-start steps | seed | held-out acc at start (warm_start, greedy) |",
             "|---|---|---|---|---|---|---|"]
    for key in keys:
        a = agents[key]
        rec = a["record"]
        lines.append(f"| {key} | {a['agent'].name} | {a['agent'].kind} | {rec.get('params', '?'):,} | "
                     f"{rec.get('total_steps', rec['steps'])} | {rec['seed']} | {rec['held_out_accuracy'] * 100:.1f} % |")
    return lines


def start_line(summaries: list[dict], runs: list[dict], names: list[str]) -> list[str]:
    """The pair's held-out accuracy at step 0, from whichever run of each agent validated then."""
    if not runs:
        return []
    zero = {n: step_zero_accuracy(summaries, runs[0], n) for n in names}
    known = {n: v for n, v in zero.items() if v is not None}
    if not known:
        return []
    return ["Held-out accuracy at step 0 measured by the trainer's validation: "
            + ", ".join(f"{n} {v * 100:.1f} %" for n, v in known.items())
            + "".join(f"; {n} not validated at step 0 by any run" for n in zero if n not in known) + ".", ""]


def pair_section(title: str, summaries: list[dict], agents: dict, pair: str, arm_keys: list[str],
                 at_step: int | None = None) -> list[str]:
    names = [agents[k]["agent"].name for k in PAIRS[pair]]
    header, sep = agent_table_header(names)
    runs = [s for s in summaries if s["pair"] == pair]
    return [title, "", *agent_lines(agents, PAIRS[pair]), "", *regime_lines(runs, names), header, sep,
            *arm_rows(runs, arm_keys, names, at_step), "", *start_line(summaries, runs, names),
            *diagnostic_lines(runs, names, arm_keys), ""]


def write_report(path: str, summaries: list[dict], agents: dict, setup: Setup, command: str, main_seeds: list[int],
                 notes: list[str], started: float, pair: str, reading: str = "", main_arms: list[str] | None = None) -> None:
    main_arms = list(ARMS) if main_arms is None else main_arms
    names = [agents[k]["agent"].name for k in PAIRS[pair]]
    families = [f for k, f in FAMILIES.items() if any(ALL_ARMS[a].family == k for a in main_arms)]
    both = len(families) > 1
    header, sep = agent_table_header(names, "its family's G" if both else "GSPO")
    main = [s for s in summaries if s["pair"] == pair and s["arm"] in main_arms]
    abl = [s for s in summaries if s["pair"] == pair and s["arm"] in ABLATIONS]
    rows = setup.prompts // setup.mini_batches * setup.group * 2
    updates = (f"{setup.mini_batches} optimizer update(s) per step for the sharing arms and GSPO×2, "
               f"{max(1, setup.mini_batches // 2)} for GSPO: every update holds {rows} rows in every arm (the paper's "
               "rule), a sharing arm's mini-batch whole prompt groups with their own and cross rows, so HACPO's update "
               f"index m runs 0..{setup.mini_batches - 1} within a step")
    title = ("# HACPO, Naive, GRAFT and SGT in miniature, each against its own family's doubling (CPU, real trainer)"
             if both else "# HACPO in miniature: does sharing rollouts buy what doubling them buys? (CPU, real trainer)")
    family_setup = [
        "GRPO family: verl's token-level PPO-clip loss (`vanilla`), clip 0.2 / 0.28, token-mean; GRAFT (`mode=graft`: "
        "complementary selection with balancing and ties, whole-group replacement with the source's advantages, gate "
        "δ = 0.8, receiver's ratio, peer-last mini-batches) and SGT (`mode=sgt`, λ = 0.1) with the same clip. "
        "Every arm follows the same rule for its updates (every update holds the same number of trained rows), "
        "so an arm with 2G or 4G rollouts also makes 2× or 4× GSPO's updates:",
        "",
        *update_plan_lines(main_arms, setup, len(names)),
        "Columns: Δ vs its family's G = paired-by-seed difference from the isolated arm at G of the arm's own family "
        "(GSPO for GSPO×2/×4, Naive, HACPO; GRPO for GRPO×2/×4, GRAFT, SGT); recovered = (X − G) / (2G − G) within "
        "the family: 1 = X buys what doubling the rollouts buys. Seeds "
        f"{main_seeds} are disjoint from the seeds of the regime search that chose this pair (0–4).",
        "",
    ] if both else []
    lines = [
        title,
        "",
        f"Command: `{command}`",
        "",
        machines_line(summaries),
        "",
        f"Written {time.strftime('%Y-%m-%d %H:%M:%S')}; this invocation took {(time.time() - started) / 60:.1f} min "
        "(runs cached from an earlier invocation are not re-timed here).",
        "",
        "## Setup",
        "",
        "Task: zero-padded 3-digit addition (`0123+0456=` → `0579`), `data/arith_add3_*.parquet`; reward 1 on exact "
        "match. Held-out accuracy: the trainer's validation — greedy decoding of "
        f"{setup.val_rows} held-out prompts — after the last step.",
        "",
        "Agents: supervised warm starts (`recipe_hacpo.warm_start`, loss on answer + EOS after each agent's own chat "
        "template), the same start for every arm and seed. Those shipped in `data/` are used as shipped.",
        "",
        f"RL: `python -m recipe_hacpo.main --config-name hacpo_cpu_demo` per run (own Ray session), {setup.steps} steps, "
        f"{setup.prompts} prompts/step, G = {setup.group} per agent (GSPO×2: {2 * setup.group}), temperature "
        f"{setup.temperature}, Adam lr {setup.lr}{' with cosine decay to 0' if setup.lr_schedule == 'cosine' else ''}, {updates}, GSPO clip 3e-4/4e-4, HACPO α = 1, δ = 0.2, "
        "δ_step = 0.025, K = 5, baseline cap 1. Seeds vary the data order (`data.seed`) and the rollout sampling seed; "
        "every comparison is paired by seed.",
        "",
        "Columns: acc % = held-out accuracy after the last step, mean ± std over seeds. Δ vs GSPO = paired-by-seed "
        "difference in points (mean ± std). Recovered = (X − GSPO) / (GSPO×2 − GSPO), a ratio of seed means, with "
        "the 5th–95th percentile over 10,000 bootstrap resamples of the seeds: 1 = the arm buys what doubling the "
        "rollouts buys, 0 = nothing over GSPO at G. Mean train reward % = on-policy reward over all steps, averaged "
        "over agents. Rollout tokens = response tokens sampled by both agents in training.",
        "",
        *family_setup,
    ]
    for family in families:
        lines += [f"## Does doubling the rollouts matter here? (pair `{pair}`, {family.label} G = {setup.group} vs "
                  f"{family.label}×2 G = {2 * setup.group})", "", *regime_lines(main, names, family=family)]
    lines += [
        f"## Main table (pair `{pair}`: {' + '.join(names)}, {PAIR_KINDS[pair]}; seeds {main_seeds})",
        "",
        *agent_lines(agents, PAIRS[pair]),
        "",
        header,
        sep,
        *arm_rows(main, main_arms, names),
        "",
        *start_line(summaries, main, names),
        *(["### Head to head (paired by seed)", "", *head_to_head_lines(main, names)] if both else []),
        "### What the sharing arms did, step by step (mean over steps, then over seeds)",
        "",
        "P̂ = capability; ω = the discrepancy coefficient applied to the peer's rows; s = the cross rows' "
        "importance ratio of §4; 'cross s < bound' / 'cross s > 1' = share of cross rows outside HACPO's clip "
        "(no gradient; 0 in Naive mode); guard groups = prompt groups per step where the §2 baseline cap "
        "replaced the shared baseline by the learner's own mean.",
        "",
        *diagnostic_lines(main, names, main_arms),
        "",
        *exchange_lines(main, names, main_arms),
    ]
    if abl:
        abl_steps = abl[0]["steps"]
        at = abl_steps if abl_steps != setup.steps else None
        abl_seeds = {a["seed"] for a in abl}
        ref = [s for s in main if s["seed"] in abl_seeds]  # every row averages the same seeds
        lines += [
            "## Ablations (HACPO with one mechanism switched off)",
            "",
            (f"The ablation runs ran {abl_steps} steps; they are compared with the main-table runs of the same seed "
             f"at step {abl_steps} (their periodic validation). " if at else "")
            + "Δ and the recovered fraction are paired with the main table's GSPO / GSPO×2 runs of the same seeds.",
            "",
            header,
            sep,
            *arm_rows(ref + abl, ["gspo", "gspo2x", "hacpo", *ABLATIONS], names, at_step=at),
            "",
            *ablation_vs_hacpo_lines(ref + abl, names, at_step=at),
            *diagnostic_lines(ref + abl, names, ["hacpo", *ABLATIONS]),
            "",
        ]
    other = sorted({s["pair"] for s in summaries} - {pair})
    if other:
        lines += ["## Kinds of heterogeneity", ""]
    for p in other:
        pn = [agents[k]["agent"].name for k in PAIRS[p]]
        lines += pair_section(f"### Pair `{p}`: {' + '.join(pn)} ({PAIR_KINDS[p]})", summaries, agents, p,
                              list(ALL_ARMS))
    if reading:
        lines += ["## Reading", "", reading.strip(), ""]
    if notes:
        lines += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


PHASES = ["gen", "reward", "old_log_prob", "exchange", "adv", "update_actor", "update_weights", "step"]


def phase_medians(runs: list[dict]) -> dict[str, float]:
    """Median per phase over every step of every run, skipping each run's first step (warm-up)."""
    out = {}
    for ph in PHASES:
        vals = [v for r in runs for v in r["timing"].get(ph, [])[1:]]
        if vals:
            out[ph] = statistics.median(vals)
    return out


def sitting_lines(runs: list[dict]) -> list[str]:
    """When the runs were made and how loaded the machine was as each started (runs that recorded it)."""
    made = sorted(r["made_at"] for r in runs if r.get("made_at"))
    loads = [r["load_at_start"] for r in runs if r.get("load_at_start") is not None]
    if not made:
        return []
    return [f"{len(made)} of these {len(runs)} runs recorded their start: from {made[0]} to {made[-1]}"
            + (f"; 1-minute load average as each started: median {statistics.median(loads):.1f}, max {max(loads):.1f}"
               if loads else "") + ".", ""]


def write_cost_profile(path: str, summaries: list[dict], setup: Setup, command: str, pair: str, parallel: int = 1,
                       arm_keys: list[str] | None = None) -> None:
    keys = arm_keys or ["gspo", "gspo2x", "naive", "hacpo"]
    arms = {k: [s for s in summaries if s["pair"] == pair and s["arm"] == k] for k in keys}
    med = {k: phase_medians(v) for k, v in arms.items() if v}
    lines = [
        "# Cost profile: time per phase per step, "
        + ("every arm of both families" if len(med) > 4 else "HACPO against isolated GSPO") + " (CPU, real trainer)",
        "",
        "A HACPO step of this checkout against the old rollout path, side by side with the same seeds, and where "
        "an actor worker's time goes: `step_speed.md` (`benchmarks/step_speed.py`).",
        "",
        f"Command: `{command}`",
        "",
        machines_line([s for runs in arms.values() for s in runs]),
        "",
        *sitting_lines([s for runs in arms.values() for s in runs]),
        f"From the `timing_s/*` metrics of the main-table runs (pair `{pair}`, {setup.prompts} prompts/step, "
        f"G = {setup.group}); median over steps 2..{setup.steps} of every seed. Both agents run each phase "
        "concurrently on their own worker groups, so a phase's time is the slower agent's."
        + (f" {parallel} runs ran at once on the 2 cores, so absolute times include contention between runs." if parallel > 1 else ""),
        "",
        "| phase (s/step) | " + " | ".join(ALL_ARMS[k].label for k in med) + " |",
        "|---|" + "---|" * len(med),
    ]
    what = {
        "gen": "generation",
        "reward": "reward (verifier)",
        "old_log_prob": "old log-probs (own rows)",
        "exchange": "exchange + re-tokenization (GRAFT: + the receiver's old log-probs of grafted rows)",
        "adv": "advantages",
        "update_actor": "update (incl. learner log-probs of cross rows)",
        "update_weights": "weight sync",
        "step": "whole step",
    }
    for ph in PHASES:
        lines.append(f"| {what[ph]} | " + " | ".join(f"{med[k].get(ph, float('nan')):.3f}" for k in med) + " |")
    lines.append("")
    if "hacpo" in med:
        h = med["hacpo"]["step"]
        lines += ["## Ratios", ""]
        if "gspo2x" in med:
            lines.append(f"- Equal per-learner group size (HACPO, G = {setup.group} per agent → {2 * setup.group} rows per "
                         f"prompt per learner, vs isolated GSPO with 2G = {2 * setup.group}): HACPO step / GSPO×2 step = "
                         f"{h:.3f} / {med['gspo2x']['step']:.3f} = **{h / med['gspo2x']['step']:.2f}×**.")
        if "gspo" in med:
            lines.append(f"- Equal per-agent sampling (HACPO G = {setup.group} vs isolated G = {setup.group}): HACPO step / "
                         f"GSPO step = {h:.3f} / {med['gspo']['step']:.3f} = **{h / med['gspo']['step']:.2f}×**.")
        if "naive" in med:
            lines.append(f"- HACPO step / Naive-sharing step = {h / med['naive']['step']:.2f}× (same rows per learner).")
        for k, label in (("gspo2x", "GSPO×2"), ("gspo", "GSPO")):
            if k in med:
                lines.append(f"- Generation time HACPO / {label}: {med['hacpo']['gen'] / med[k]['gen']:.2f}×; update time "
                             f"HACPO / {label}: {med['hacpo']['update_actor'] / med[k]['update_actor']:.2f}×.")
    family_ratios = [(a, b) for a, b in (("graft", "grpo2x"), ("graft", "grpo"), ("sgt", "grpo"), ("graft", "hacpo"),
                                         ("gspo4x", "gspo2x"), ("grpo4x", "grpo2x"), ("grpo", "gspo"))
                     if a in med and b in med]
    if family_ratios:
        lines += ["", "Other steps against each other (whole step, median):", ""]
        lines += [f"- {ALL_ARMS[a].label} / {ALL_ARMS[b].label}: {med[a]['step']:.3f} / {med[b]['step']:.3f} = "
                  f"**{med[a]['step'] / med[b]['step']:.2f}×**." for a, b in family_ratios]
    if "hacpo" in med:
        lines += [
            "",
            "The trainer computes the learner's log-probs of cross rows inside the update's forward pass (they are the "
            "π_θ of the HACPO loss), so 'cross log-probs' has no phase of its own: it is part of `update_actor`. "
            "Exchange = detokenize → re-tokenize with the learner's tokenizer → re-render the prompt with the learner's "
            "chat template, on the driver.",
            "",
        ]
    with open(path, "w") as f:
        f.write("\n".join(lines))
