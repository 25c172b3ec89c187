"""Shared pytest fixtures: tiny offline agents and their tokenizers, built once per test run (the
workers of `pytest -n 2` share what one of them built: helpers/built_once.py)."""

from __future__ import annotations

import pytest

from pathlib import Path

from helpers.built_once import built_once
from recipe_hacpo import tiny_agents

# The warm starts of `warm_agent_paths` and `warm_real_agent_paths`, kept as states over their
# seeded inits (recipe_hacpo.warm_start.save_trained_state): training them here would give other
# weights on another CPU kind (measured under ATEN_CPU_CAPABILITY=avx2: the tiny agents' weights
# 1e-4 apart relative after 40 steps, the real-tokenizer agents' 0.5 apart after 100), and the
# golden runs that start from them must start from the same bits everywhere. A missing file is
# made by training (delete one to re-make it after changing its arguments).
WARM_STATES = Path(__file__).resolve().parent / "fixtures" / "warm_agents"


def warm_agent(args, out: str) -> None:
    """The agent `warm_start(args, out)` makes, rebuilt from its kept state."""
    from recipe_hacpo.warm_start import reusable, restore_trained_state, save_trained_state, warm_start

    state = WARM_STATES / f"{args.kind}.safetensors"
    if not state.exists():
        warm_start(args, out, verbose=False)
        save_trained_state(out, str(state))
    restore_trained_state(str(state), out)
    assert reusable(args, out), f"{state} was made with other warm-start arguments than {args}; delete it to re-make it"


@pytest.fixture(scope="session")
def tiny_agent_paths(tmp_path_factory) -> dict[str, str]:
    """{kind: checkpoint dir} for every default tiny agent, loadable with `from_pretrained`."""
    return built_once(tmp_path_factory, "tiny_agents", lambda root: tiny_agents.build_default_agents(str(root)))


@pytest.fixture(scope="session")
def char_tokenizer():
    """The character-level (Qwen2-layout) tokenizer, built in-process."""
    return tiny_agents.build_char_tokenizer()


@pytest.fixture(scope="session")
def pair_tokenizer():
    """The digit-pair (Llama-3-style template) tokenizer, built in-process."""
    return tiny_agents.build_pair_tokenizer()


@pytest.fixture(scope="session")
def warm_agent_paths(tmp_path_factory) -> dict[str, str]:
    """{kind: checkpoint dir} of tiny agents briefly trained on single-digit addition.

    Random-init agents almost never answer correctly, so every group's rewards are equal and
    RL has nothing to learn from; a short supervised start gives them a mixed success rate.
    """
    from recipe_hacpo.warm_start import WarmStartArgs

    def build(root) -> dict[str, str]:
        paths = {}
        for kind in tiny_agents.DEFAULT_KINDS:
            out = str(root / kind)
            warm_agent(WarmStartArgs(kind=kind, task="add1", steps=40, n_train=2000, n_eval=200, batch_size=64), out)
            paths[kind] = out
        return paths

    return built_once(tmp_path_factory, "warm_agents", build)


@pytest.fixture(scope="session")
def hacpo_pair_reference(tmp_path_factory, warm_agent_paths) -> tuple[str, dict[int, dict]]:
    """(output dir, {step: metrics}) of one uninterrupted 3-step HACPO run of the warm-started
    pair, every step checkpointed under `<dir>/ckpt`: the run that tests/test_reliability.py's and
    tests/test_preemption.py's interrupted and resumed runs must reproduce. Made once per test run:
    checkpoints do not change what a run trains, so both compare with the same run."""
    from helpers.e2e import HACPO_PAIR_KINDS, HACPO_PAIR_RUN, agent_overrides, run_main, train_steps

    def build(root) -> tuple[str, dict[int, dict]]:
        records = run_main(str(root), agent_overrides(warm_agent_paths, HACPO_PAIR_KINDS) + HACPO_PAIR_RUN
                           + ["trainer.save_freq=1", f"trainer.record_samples_dir={root}/samples"])
        return str(root), train_steps(records)

    return built_once(tmp_path_factory, "hacpo_pair_reference", build)


# the presets' pair in miniature: Qwen3 (tied) and Llama-3.2 (tied), with the real tokenizers
REAL_PAIR = ("qwen3-tied", "llama3p2-tied")


@pytest.fixture(scope="session")
def warm_real_agent_paths(tmp_path_factory) -> dict[str, str]:
    """{kind: checkpoint dir} of the presets' architectures (`tiny_agents.REAL_ARCH_KINDS`, real
    Qwen3 / Llama-3 tokenizers) briefly trained on single-digit addition, as `warm_agent_paths`.

    Their 128k-152k-id output layers learn slower than the tiny tokenizers' few hundred ids:
    100 steps at lr 1e-2 (not 40 at 2e-3, which leaves Llama-3.2 at 0 % greedy accuracy), of the
    embeddings only the rows of the task's tokens (so that the kept state is small), give a
    held-out greedy accuracy of 21 % (Qwen3) and 40 % (Llama-3.2) on 200 prompts, so that groups
    get mixed rewards."""
    from recipe_hacpo.warm_start import WarmStartArgs

    def build(root) -> dict[str, str]:
        paths = {}
        for kind in REAL_PAIR:
            out = str(root / kind)
            warm_agent(WarmStartArgs(kind=kind, task="add1", steps=100, lr=1e-2, n_train=2000, n_eval=200,
                                     batch_size=64, task_rows_only=True), out)
            paths[kind] = out
        return paths

    return built_once(tmp_path_factory, "warm_real_agents", build)


@pytest.fixture
def demo_overrides(tiny_agent_paths) -> list[str]:
    """hacpo_cpu_demo's two agents pointed at the tiny models of `tiny_agent_paths`."""
    return [
        f"agents.qwen_char.model_path={tiny_agent_paths['qwen2-char-small']}",
        f"agents.llama_pair.model_path={tiny_agent_paths['llama-pair-medium']}",
    ]
