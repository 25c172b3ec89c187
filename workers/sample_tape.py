"""Sample tapes (`hf` backend): the tokens each sampled request drew, recorded in one run and
replayed in another.

Two machines whose CPUs (or GPUs) run other vector kernels compute a policy's logits a few ulps
apart; now and then two candidates of a Gumbel-max draw are that close and the machines sample
different tokens, after which the runs part ways (other rewards, other groups, other updates).
A tape takes the sampling out of that comparison: a run that replays another run's tape
generates the same responses token for token, while everything computed from them (the
engine's and the trainer's log-probs, losses, gradients, the exchange) is still computed here.

Recording (`trainer.record_samples_dir=DIR`): every sampled request appends one line
`{"seed": s, "tokens": [...]}` to DIR/<agent>/<host>-<pid>.jsonl, `s` being the request's
sampling seed (`seeded_sampling.request_seed`: rollout seed, step, request id and prompt).

Replay (`trainer.replay_samples_dir=DIR`): each sampled request of agent A takes the tokens
recorded under its seed in DIR/<A>/*.jsonl instead of drawing them; a request whose seed the
tape lacks, or whose generation ends elsewhere than the tape (another token budget or EOS set),
fails the batch with a line that names the agent, the seed and the folder.

Both need `rollout.full_determinism=true`: the seed is what finds a request on the tape.
Greedy requests (validation) are neither recorded nor replayed.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

TAPE_SUFFIX = ".jsonl"
# `rollout.custom` keys that carry one agent's tape folders to its rollout servers
# (recipe_hacpo.config.agent_verl_config sets them from the trainer keys)
RECORD_KEY, REPLAY_KEY = "record_samples", "replay_samples"


class TapeMismatch(RuntimeError):
    """A replayed request that the tape cannot serve (no line for its seed, another ending)."""


def tape_files(agent_dir: str | os.PathLike) -> list[Path]:
    return sorted(Path(agent_dir).glob(f"*{TAPE_SUFFIX}"))


def read_tape(agent_dir: str | os.PathLike) -> dict[int, list[int]]:
    """{seed: tokens} of every tape file in one agent's folder. A seed recorded twice (a step
    generated again after a resume) must have drawn the same tokens both times."""
    tape: dict[int, list[int]] = {}
    for path in tape_files(agent_dir):
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                    seed, tokens = int(entry["seed"]), [int(t) for t in entry["tokens"]]
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{number}: not a tape line ({type(exc).__name__}: {exc})") from None
                if tape.setdefault(seed, tokens) != tokens:
                    raise ValueError(f"{path}:{number}: seed {seed} recorded twice with different tokens")
    return tape


def write_tape(tape: dict[int, list[int]], path: str | os.PathLike) -> None:
    """One tape file, its lines sorted by seed (a stable file to keep under version control)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for seed in sorted(tape):
            f.write(json.dumps({"seed": seed, "tokens": tape[seed]}, separators=(",", ":")) + "\n")


class TapeRecorder:
    """Appends this process's sampled requests to its own file in one agent's folder: replicas
    and restarted servers never write to the same file."""

    def __init__(self, agent_dir: str | os.PathLike):
        os.makedirs(agent_dir, exist_ok=True)
        self.path = Path(agent_dir) / f"{socket.gethostname()}-{os.getpid()}{TAPE_SUFFIX}"

    def append(self, seeds: list[int], tokens: list[list[int]]) -> None:
        with open(self.path, "a") as f:
            for seed, row in zip(seeds, tokens, strict=True):
                f.write(json.dumps({"seed": int(seed), "tokens": [int(t) for t in row]}, separators=(",", ":")) + "\n")


class TapeReplay:
    """One agent's tape, served to the engine by request seed."""

    def __init__(self, agent_dir: str | os.PathLike, agent: str):
        self.agent_dir, self.agent = str(agent_dir), agent
        self.tape = read_tape(agent_dir)
        if not self.tape:
            raise TapeMismatch(f"{agent}: replay_samples folder {self.agent_dir} holds no {TAPE_SUFFIX} tape lines")

    def tokens_for(self, seeds: list[int]) -> list[list[int]]:
        missing = [s for s in seeds if s not in self.tape]
        if missing:
            raise TapeMismatch(
                f"{self.agent}: no recorded sample for request seed {missing[0]} ({len(missing)} of {len(seeds)} "
                f"requests) in {self.agent_dir}: this run asks for other rollouts than the recorded run "
                "(another seed, data order, step or prompt)"
            )
        return [self.tape[s] for s in seeds]

    def check_generated(self, seeds: list[int], generated: list[list[int]]) -> None:
        """Every replayed row must end where its tape line ends."""
        for seed, tokens in zip(seeds, generated, strict=True):
            if tokens != self.tape[seed]:
                raise TapeMismatch(
                    f"{self.agent}: request seed {seed} generated {len(tokens)} tokens where the tape in "
                    f"{self.agent_dir} holds {len(self.tape[seed])}: the run stops generating elsewhere than the "
                    "recorded run (another response_length, EOS or stop tokens)"
                )
