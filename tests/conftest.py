"""Shared pytest fixtures: tiny offline agents and their tokenizers (built once per session)."""

from __future__ import annotations

import pytest

from recipe_hacpo import tiny_agents


@pytest.fixture(scope="session")
def tiny_agent_paths(tmp_path_factory) -> dict[str, str]:
    """{kind: checkpoint dir} for every default tiny agent, loadable with `from_pretrained`."""
    return tiny_agents.build_default_agents(str(tmp_path_factory.mktemp("tiny_agents")))


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
    from recipe_hacpo.warm_start import WarmStartArgs, warm_start

    root = tmp_path_factory.mktemp("warm_agents")
    paths = {}
    for kind in tiny_agents.DEFAULT_KINDS:
        out = str(root / kind)
        warm_start(
            WarmStartArgs(kind=kind, task="add1", steps=40, n_train=2000, n_eval=200, batch_size=64),
            out,
            verbose=False,
        )
        paths[kind] = out
    return paths
