"""GRAFT against a recorded peer (docs/ALGORITHM.md §9, replay): train one agent alone on a peer's
rollouts recorded during an earlier run, without the peer in memory.

Recording, in any run (`trainer.record_rollouts_dir=DIR`): every step, after the old log-probs,
each agent's scored rollouts (prompts, responses, its old log-probs, its rewards) are written to
DIR/<agent>/step_<k>.pkl, and DIR/<agent>/manifest.json names the agent's model (for its tokenizer)
and its n.

Replay (`algorithm.hacpo.mode=graft`, `algorithm.hacpo.replay_peer=DIR/<agent>`, one agent in
`agents`): in step k the recording of step k stands in for a live source S of the receiver R:

    R1  the recording holds the step's prompts (the same uids and the same prompt messages), so the
        run must read the data in the recording run's order (data.seed, train_files,
        train_batch_size); anything else stops the run before the update, naming the step
    R2  the recorded rewards are not trusted: this run's verifier scores the recorded responses
        again, decoded with the recorded agent's tokenizer
    R3  GRAFT's selection in one direction, unbalanced (there is no R → S direction to balance):
        R takes S's whole group for q ∈ C_{S→R} = {q : k_R(q) = 0, 1 ≤ k_S(q) < n_S}
    R4  everything after the selection is GRAFT's: S's GRPO advantages on its full recorded group,
        R's old log-probs of the re-tokenized rows and w against S's recorded mean log-prob (gate
        δ), the token-level loss against R's own old policy, peer-last mini-batches

This module records, reads and checks recordings; the step's exchange against one
(`replay_exchange`) is GRAFT's, in recipe_hacpo/methods/graft.py.
"""

from __future__ import annotations

import json
import os

import torch

from recipe_hacpo.atomic_io import atomic_write_json, fsync_dir
from recipe_hacpo.methods.graft_formulas import complementary_candidates
from recipe_hacpo.hacpo_settings import ConfigError
from verl import DataProto


MANIFEST = "manifest.json"


def step_file(agent_dir: str, step: int) -> str:
    return os.path.join(agent_dir, f"step_{step}.pkl")


def record_rollouts(root: str, step: int, rollouts: dict[str, DataProto], specs) -> None:
    """Write every agent's scored rollouts of `step` under root/<agent>/ (each file atomically)."""
    for spec in specs:
        agent_dir = os.path.join(root, spec.name)
        os.makedirs(agent_dir, exist_ok=True)
        manifest = os.path.join(agent_dir, MANIFEST)
        if not os.path.exists(manifest):
            atomic_write_json(manifest, {"name": spec.name, "model_path": spec.model_path, "rollout_n": spec.rollout_n})
        path = step_file(agent_dir, step)
        rollouts[spec.name].save_to_disk(path + ".tmp")
        os.replace(path + ".tmp", path)
        fsync_dir(agent_dir)


def read_manifest(agent_dir: str) -> dict:
    """The recorded agent's manifest, or a one-line ConfigError naming the key and the path."""
    path = os.path.join(agent_dir, MANIFEST)
    key = "algorithm.hacpo.replay_peer"
    if not os.path.isdir(agent_dir):
        raise ConfigError(f"{key}={agent_dir!r}: no such directory (a recorded agent's folder, DIR/<agent>)")
    if not os.path.isfile(path):
        raise ConfigError(f"{key}={agent_dir!r}: no {MANIFEST}; record with trainer.record_rollouts_dir=DIR and "
                          "point at DIR/<agent>")
    try:
        with open(path) as f:
            manifest = json.load(f)
        for field in ("name", "model_path", "rollout_n"):
            manifest[field]  # noqa: B018 - each must be present
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{key}: {path} is not a recording manifest ({exc})") from exc
    return manifest


def replay_selection(correct: torch.Tensor, peer_n: int) -> torch.Tensor:
    """R3: the prompts whose group the receiver takes from the recorded peer, bool [Q]: GRAFT's
    candidates of the direction S → R (`graft.complementary_candidates`), not balanced.

        C_{S→R} = { q : k_R(q) = 0  and  1 ≤ k_S(q) < n_S }

    Args:
        correct: [k_R(q), k_S(q)], long [2, Q].
        peer_n: n_S (the receiver's n is the same; config.py checks it).
    """
    return complementary_candidates(correct, torch.tensor([peer_n, peer_n]))[1, 0]


def _prompt_key(messages) -> str:
    return json.dumps(messages.tolist() if hasattr(messages, "tolist") else messages, sort_keys=True, default=str)


def check_same_prompts(recorded: DataProto, live: DataProto, where: str) -> None:
    """R1: the recording holds exactly the live step's prompts (uid → prompt messages)."""
    def by_uid(batch: DataProto) -> dict[str, str]:
        return {u: _prompt_key(p) for u, p in zip(batch.non_tensor_batch["uid"], batch.non_tensor_batch["raw_prompt"])}

    want, have = by_uid(live), by_uid(recorded)
    missing = sorted(set(want) - set(have))
    differing = sorted(u for u in want if u in have and want[u] != have[u])
    if missing or differing:
        first = (missing or differing)[0]
        what = "has no rows of" if missing else "holds another prompt under"
        raise ValueError(f"{where}: the recording {what} {first} ({len(missing)} prompts missing, {len(differing)} "
                         "differing); replay needs the recording run's data order (data.seed, train_files, "
                         "train_batch_size)")


class RecordedPeer:
    """A recorded agent as a GRAFT source: its tokenizer, its n, and its rollouts step by step."""

    def __init__(self, agent_dir: str) -> None:
        from verl.utils import hf_tokenizer
        from verl.utils.fs import copy_to_local

        from recipe_hacpo.exchange.retokenize import eos_token_ids

        self.dir = agent_dir
        manifest = read_manifest(agent_dir)
        self.name = str(manifest["name"])
        self.rollout_n = int(manifest["rollout_n"])
        local = copy_to_local(str(manifest["model_path"]))
        self.tokenizer = hf_tokenizer(local)
        self.eos_token_ids = eos_token_ids(local, self.tokenizer)
        self.key = f"recorded:{self.name}"  # its place among the step's rollouts, apart from any live agent

    def load(self, step: int, live: DataProto) -> DataProto:
        """The recording of `step`, checked against the live step's prompts (R1), not yet scored."""
        path = step_file(self.dir, step)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"algorithm.hacpo.replay_peer: no recording of step {step} ({path})")
        recorded = DataProto.load_from_disk(path)
        check_same_prompts(recorded, live, f"algorithm.hacpo.replay_peer, step {step} ({path})")
        return recorded

