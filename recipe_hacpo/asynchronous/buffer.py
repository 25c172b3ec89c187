"""Verified rollouts that agents share without waiting: a versioned buffer with a bounded lag.

An entry is one source agent's answers to one batch, published once they are scored and carry
the source's own old log-probs: (source, batch, version, capability, payload). `version` is the
source's optimizer steps when it sampled (v_k); `capability` its P̂ at that version, so the
learner's ω for those rows comes from the policy that sampled them.

A learner takes, at the start of its update, at most one entry per peer:
- the peer's entry of the learner's own batch (a joint group), when the peer published it;
- else the peer's freshest admissible entry (a group of cross rows only);
admissible = not taken by this learner before, and its source lag (the source's version now
minus the entry's version) at most `max_source_lag` K. Each take returns a manifest line per
entry (learner, learner version, source, batch, version, lag), which is logged and checkpointed.

An entry leaves the buffer once every other agent took it (consumed) or its lag passed K before
some agent took it (evicted stale, counted). K bounds freshness and memory, not correctness:
HACPO's cross ratio is taken against the source's own behaviour log-probs at `version`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Entry:
    source: str
    batch: int
    version: int
    capability: float
    payload: Any = None  # what a learner needs of the rows (compact; opaque here)
    nbytes: int = 0
    taken_by: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Taken:
    """One line of a consumption manifest."""

    learner: str
    learner_version: int
    source: str
    batch: int
    version: int
    lag: int
    joint: bool  # the learner answered this batch in the same step (a joint group)


class RowBuffer:
    """Published entries, the sources' current versions, and every manifest line so far."""

    def __init__(self, agents: tuple[str, ...], max_source_lag: int = 4) -> None:
        if max_source_lag < 0:
            raise ValueError(f"trainer.async.max_source_lag must be >= 0, got {max_source_lag}")
        self.agents = tuple(agents)
        self.max_source_lag = int(max_source_lag)
        self.versions: dict[str, int] = {a: 0 for a in self.agents}
        self.entries: list[Entry] = []
        self.manifest: list[Taken] = []
        self.evicted_stale = 0

    def lag(self, entry: Entry) -> int:
        return self.versions[entry.source] - entry.version

    def publish(self, entry: Entry) -> None:
        if entry.source not in self.versions:
            raise KeyError(f"agent {entry.source!r} is not one of {list(self.agents)}")
        if entry.version != self.versions[entry.source]:
            raise ValueError(f"agent {entry.source!r}: rows of batch {entry.batch} sampled by version {entry.version} "
                             f"but it is at version {self.versions[entry.source]}")
        if any(e.source == entry.source and e.batch == entry.batch for e in self.entries):
            raise ValueError(f"agent {entry.source!r} published batch {entry.batch} twice")
        self.entries.append(entry)

    def set_version(self, agent: str, version: int) -> None:
        """`agent` finished optimizer step `version`; entries it published go stale with it."""
        self.versions[agent] = int(version)
        self._evict()

    def take(self, learner: str, batch: int, learner_version: int, peers: tuple[str, ...] | None = None,
             joint_only: bool = False) -> list[Entry]:
        """At most one entry per peer for `learner`'s update on `batch` (the rule above); with
        `joint_only`, only peers' entries of `batch` itself (methods that compare the agents'
        answers to the same prompts: GRAFT, SGT)."""
        peers = tuple(p for p in (self.agents if peers is None else peers) if p != learner)
        chosen = []
        for peer in peers:
            candidates = [e for e in self.entries
                          if e.source == peer and learner not in e.taken_by and self.lag(e) <= self.max_source_lag
                          and (e.batch == batch or not joint_only)]
            if not candidates:
                continue
            same = [e for e in candidates if e.batch == batch]
            entry = same[0] if same else max(candidates, key=lambda e: (e.version, e.batch))
            entry.taken_by.add(learner)
            self.manifest.append(Taken(learner, learner_version, peer, entry.batch, entry.version,
                                       self.lag(entry), joint=entry.batch == batch))
            chosen.append(entry)
        self._evict()
        return chosen

    def taken_at(self, learner: str, learner_version: int) -> list[Taken]:
        """The manifest lines of `learner`'s take at `learner_version` (one take: contiguous lines,
        the learner's newest), found from the end of the manifest."""
        lines = []
        for i in range(len(self.manifest) - 1, -1, -1):
            line = self.manifest[i]
            if line.learner != learner:
                continue
            if line.learner_version != learner_version:
                break
            lines.append(line)
        return lines[::-1]

    def _evict(self) -> None:
        kept = []
        for e in self.entries:
            waiting = [a for a in self.agents if a != e.source and a not in e.taken_by]
            if not waiting:
                continue
            if self.lag(e) > self.max_source_lag:
                self.evicted_stale += 1
                continue
            kept.append(e)
        self.entries = kept

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def state_dict(self) -> dict:
        return {
            "agents": list(self.agents), "max_source_lag": self.max_source_lag, "versions": dict(self.versions),
            "entries": [{"source": e.source, "batch": e.batch, "version": e.version, "capability": e.capability,
                         "payload": e.payload, "nbytes": e.nbytes, "taken_by": sorted(e.taken_by)}
                        for e in self.entries],
            "manifest": [t.__dict__.copy() for t in self.manifest],
            "evicted_stale": self.evicted_stale,
        }

    @classmethod
    def from_state(cls, state: dict) -> "RowBuffer":
        buf = cls(tuple(state["agents"]), int(state["max_source_lag"]))
        buf.versions = {k: int(v) for k, v in state["versions"].items()}
        buf.entries = [Entry(e["source"], int(e["batch"]), int(e["version"]), float(e["capability"]), e["payload"],
                             int(e["nbytes"]), set(e["taken_by"])) for e in state["entries"]]
        buf.manifest = [Taken(**t) for t in state["manifest"]]
        buf.evicted_stale = int(state["evicted_stale"])
        return buf
