"""The tiny agents, the pairs of them (the kinds of heterogeneity) and their warm starts."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass

from mini.common import DATA_DIR, log

@dataclass(frozen=True)
class Agent:
    name: str  # agent name in the trainer (metrics prefix)
    kind: str  # recipe_hacpo.tiny_agents kind
    steps: int  # supervised warm-start steps (on top of `init`'s, if any)
    seed: int
    dirname: str
    init: str = ""  # key of the agent this one continues from
    n_train: int = 50_000
    lr: float = 0.0  # this agent's RL Adam lr; 0: the benchmark's --lr

    @property
    def run_id(self) -> str:
        """How runs record this agent: its warm start, and its own lr where it has one."""
        return self.dirname + (f"@lr{self.lr:g}" if self.lr else "")


# warm starts shipped with the repository (weights, tokenizer and their warm_start record)
SHIPPED_AGENTS = (os.path.join(DATA_DIR, "demo_agents"), os.path.join(DATA_DIR, "bench_agents"))

AGENTS = {
    # Q, L, Q1, M, M9, M12 and M18 are shipped in data/ (each made by the warm_start call its record
    # names): a character model's held-out accuracy jumps abruptly during supervised training, and
    # where it jumps differs between machines (4.6 %, 34.8 % and 57.8 % after 1000 steps have been
    # seen), so agents retrained here would not be the agents of the committed results. Shipped ones are.
    # Q: Qwen2-style, hidden 64, 2 layers, character tokenizer, 1500 SFT steps, seed 0 (66 % held-out).
    "Q": Agent("qwen_char", "qwen2-char-small", 1500, 0, "qwen2-char-small_add3_1500_s0"),
    # L: Llama-style, hidden 96, 3 layers, digit-pair tokenizer, 1200 SFT steps (17 %).
    "L": Agent("llama_pair", "llama-pair-medium", 1200, 0, "llama-pair-medium_add3_1200_s0"),
    # Q1: Q's architecture and tokenizer, another warm start (seed 1: other init and data order, 81 %).
    "Q1": Agent("qwen_char_b", "qwen2-char-small", 1500, 1, "qwen2-char-small_add3_1500_s1"),
    # M: Qwen2-style, hidden 96, 3 layers, the same character tokenizer as Q, 650 SFT steps (26 %).
    "M": Agent("qwen_char_medium", "qwen2-char-medium", 650, 0, "qwen2-char-medium_add3_650_s0"),
    # M12: M's kind, seed and data, stopped at 555 SFT steps, in the middle of its jump (12 %): the
    # one character agent found whose RL gain grows with rollouts (M plateaus near 60 % within 10
    # steps at any group size; M9, stopped at 540 steps (9 %), hardly learns by RL at all).
    "M12": Agent("qwen_char_early", "qwen2-char-medium", 555, 0, "qwen2-char-medium_add3_555_s0"),
    "M9": Agent("qwen_char_early", "qwen2-char-medium", 540, 0, "qwen2-char-medium_add3_540_s0"),
    # M18: M12 continued for 20 SFT steps (a fresh optimizer, data from seed 0; 18 %): the character
    # agent whose gain from doubled rollouts is steady across seeds (M12's varies 2.5 to 8 points)
    "M18": Agent("qwen_char_early", "qwen2-char-medium", 20, 0, "qwen2-char-medium_add3_555_s0_then20", init="M12"),
    # M9h: M9 trained by RL at lr 3e-4 (it collapses)
    "M9h": Agent("qwen_char_early", "qwen2-char-medium", 540, 0, "qwen2-char-medium_add3_540_s0", lr=3e-4),
    # A, B0 -> B: the pair the step-speed benchmark times (benchmarks/step_speed.py; trained there,
    # tiny versions with --agents smoke). A: qwen2-char-small 1000 SFT steps; B: llama-pair-medium
    # 1000 + 2000 SFT steps (39 %; B0 and B are shipped too: B keeps gaining from RL for 40 steps
    # and more with doubled rollouts, see benchmarks/results/regime_search.md).
    "A": Agent("qwen_small", "qwen2-char-small", 1000, 0, "A_qwen_char_small_1000"),
    "B0": Agent("llama_pair_early", "llama-pair-medium", 1000, 0, "B_llama_pair_medium_1000"),
    "B": Agent("llama_pair", "llama-pair-medium", 2000, 0, "B_llama_pair_medium_3000", init="B0"),
}

# the paper's three kinds of heterogeneity; state and size hold M12 (measured before M18 was found)
PAIRS = {
    # the main table: different architecture and tokenizer, GSPO×2 beating GSPO by more than 3 std of
    # the paired difference for both agents (benchmarks/results/miniature.md)
    "model_m18b": ("M18", "B"),
    # the main pair before M18: GSPO×2 beat GSPO on every seed for both, by 3 std for B only
    "model": ("M12", "B"),
    "state": ("M12", "M"),  # same model, tokenizer and supervised run, stopped at 555 and 650 steps
    "size": ("Q", "M12"),  # same family and tokenizer, different sizes
    # pairs of earlier settings (benchmarks/results/regime_search.md and the git history of miniature.md)
    "model_ml": ("M", "L"),  # the main pair before M12 and B: both at 10–30 %, doubling within noise
    "model_gap": ("Q", "L"),  # different architecture, tokenizer and size, a wide gap (66 % and 17 %)
    "state_qq1": ("Q", "Q1"),
    "size_qm": ("Q", "M"),
    # settings probed for a regime where doubling the rollouts matters (benchmarks/regime_search.py)
    "model_b": ("M", "B"),
    "model_q1b": ("Q1", "B"),
    "model_m9b": ("M9", "B"),
    "model_m9hb": ("M9h", "B"),
}
PAIR_KINDS = {
    "model_m18b": "model heterogeneity: different architecture and tokenizer (a character Qwen2 at 18 %, a digit-pair Llama at 39 %)",
    "model": "model heterogeneity, the main pair before M18: different architecture and tokenizer (a character Qwen2 at 12 %, a digit-pair Llama at 39 %)",
    "state": "state heterogeneity: one model, tokenizer and supervised run, stopped at two points (12 % and 26 %)",
    "size": "size heterogeneity: same family and tokenizer, different sizes (small 66 %, medium 12 %)",
    "model_ml": "model heterogeneity: different architecture and tokenizer, both agents at 10–30 %",
    "model_gap": "model heterogeneity with a wide capability gap: different architecture, tokenizer and size",
    "state_qq1": "state heterogeneity: same architecture and tokenizer, different warm starts",
    "size_qm": "size heterogeneity: same family and tokenizer, different sizes",
    "model_b": "model heterogeneity (regime probe): a character Qwen2 at 26 % and a digit-pair Llama at 39 %",
    "model_q1b": "model heterogeneity (regime probe): a character Qwen2 at 81 % and a digit-pair Llama at 39 %",
    "model_m9b": "model heterogeneity (regime probe): a character Qwen2 at 9 % and a digit-pair Llama at 39 %",
    "model_m9hb": "model heterogeneity (regime probe): a character Qwen2 at 9 % (RL lr 3e-4) and a digit-pair Llama at 39 %",
}


def warm_agents(keys: list[str], agents_dir: str, smoke: bool) -> dict[str, dict]:
    from recipe_hacpo.warm_start import WarmStartArgs, warm_start

    out: dict[str, dict] = {}

    def warm(key: str) -> None:
        if key in out:
            return
        a = AGENTS[key]
        init = ""
        if a.init:
            warm(a.init)
            init = out[a.init]["path"]
        if smoke:
            args = WarmStartArgs(kind=a.kind, task="add3", steps=5, seed=a.seed, n_train=256, n_eval=64, init=init)
            path = os.path.join(agents_dir, a.dirname + "_smoke")
        else:
            args = WarmStartArgs(kind=a.kind, task="add3", steps=a.steps, seed=a.seed, n_train=a.n_train, init=init)
            path = os.path.join(agents_dir, a.dirname)
            shipped = [os.path.join(d, a.dirname) for d in SHIPPED_AGENTS if os.path.isdir(os.path.join(d, a.dirname))]
            if not os.path.exists(path) and shipped:
                shutil.copytree(shipped[0], path)  # warm_start reuses it: its record matches these arguments
        t0 = time.perf_counter()
        rec = warm_start(args, path, verbose=False)
        log(f"agent {key} ({a.kind}, seed {a.seed}, {rec.get('total_steps', args.steps)} SFT steps): held-out "
            f"{rec['held_out_accuracy']:.3f} ({time.perf_counter() - t0:.0f}s, cached if ~0s) -> {path}")
        out[key] = {"path": path, "record": rec, "agent": a}

    for key in keys:
        warm(key)
    return {k: out[k] for k in keys}
