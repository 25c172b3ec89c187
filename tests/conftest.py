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
