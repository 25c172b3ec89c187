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


# the uninterrupted 3-step run of the two warm agents (CPU demo config, hf backend) that the
# kill-and-resume tests compare with (tests/test_reliability.py, tests/test_preemption.py): one
# launch for the session instead of one per test
HF_REFERENCE_STEPS = 3


def hf_reference_args(paths: dict[str, str]) -> list[str]:
    """The Hydra overrides shared by the reference run and the runs compared with it."""
    agents = ",".join(
        f"{{name:{name},model_path:'{paths[kind]}',rollout_n:4,n_gpus_per_node:1,nnodes:1,actor_rollout_ref:{{}}}}"
        for kind, name in (("qwen2-char-small", "qwen_char"), ("llama-pair-medium", "llama_pair"))
    )
    return [f"agents=[{agents}]", "ray_kwargs.ray_init.num_gpus=2", f"trainer.total_training_steps={HF_REFERENCE_STEPS}",
            "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.resume_mode=auto"]


@pytest.fixture(scope="session")
def hf_reference_run(tmp_path_factory, warm_agent_paths) -> str:
    """The output dir of the uninterrupted run: metrics.jsonl, and ckpt/ with every step's checkpoint."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = str(tmp_path_factory.mktemp("hf_reference"))
    cmd = [sys.executable, "-m", "recipe_hacpo.main", "--config-name", "hacpo_cpu_demo", "trainer.logger=[console,file]",
           f"trainer.default_local_dir={out}/ckpt", f"hydra.run.dir={out}/hydra", "trainer.progress_bar=false",
           *hf_reference_args(warm_agent_paths), "trainer.save_freq=1"]
    env = dict(os.environ, VERL_FILE_LOGGER_PATH=os.path.join(out, "metrics.jsonl"),
               HACPO_DATA_DIR=os.path.join(repo, "data"))
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out
