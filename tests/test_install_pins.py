"""The `gpu` extra of pyproject.toml agrees with what the installed verl declares.

verl 0.9.1 pins its vLLM stack in its own `vllm` extra (vLLM, torch, transformers, ...); a
`gpu` extra that asks for anything those pins do not satisfy lets pip resolve a combination
verl never ran. flash-attn compiles against the torch it finds, so it stays out of `gpu`.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _project() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["project"]


def _verl_extra(extra: str) -> dict[str, Requirement]:
    """verl's requirements that apply only with `extra`, by canonical name."""
    out = {}
    for line in md.requires("verl") or []:
        req = Requirement(line)
        if req.marker is not None and req.marker.evaluate({"extra": extra}) and not req.marker.evaluate({"extra": ""}):
            out[canonicalize_name(req.name)] = req
    return out


def _pinned(req: Requirement) -> str | None:
    specs = list(req.specifier)
    return specs[0].version if len(specs) == 1 and specs[0].operator == "==" else None


def test_gpu_extra_asks_for_verls_vllm_extra_of_the_installed_version():
    gpu = [Requirement(r) for r in _project()["optional-dependencies"]["gpu"]]
    verl = [r for r in gpu if canonicalize_name(r.name) == "verl"]
    assert verl and "vllm" in verl[0].extras
    assert md.version("verl") in verl[0].specifier


def test_gpu_extra_does_not_contradict_verls_vllm_pins():
    pins = _verl_extra("vllm")
    # the core of verl's vLLM stack is pinned there
    assert {"vllm", "torch", "transformers"} <= set(pins)
    project = _project()
    ours = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["gpu"]]
    checked = 0
    for req in ours:
        pin = pins.get(canonicalize_name(req.name))
        if pin is None or _pinned(pin) is None:
            continue
        assert _pinned(pin) in req.specifier, f"{req} contradicts verl's {pin}"
        checked += 1
    gpu_names = {canonicalize_name(Requirement(r).name) for r in project["optional-dependencies"]["gpu"]}
    # vLLM, torch and transformers are named in the gpu extra itself, at verl's versions
    assert {"vllm", "torch", "transformers"} <= gpu_names and checked >= 3


def test_flash_attn_is_a_separate_extra_at_verls_version():
    extras = _project()["optional-dependencies"]
    assert not any(canonicalize_name(Requirement(r).name) == "flash-attn" for r in extras["gpu"])
    ours = [Requirement(r) for r in extras["flash-attn"]]
    verl = [r for name, r in _verl_extra("flash-attn-cu130torch211").items() if name == "flash-attn"]
    assert len(ours) == 1 and verl and _pinned(verl[0]) in ours[0].specifier


# ------------------------------------------------------------------ the documented GPU install lines
REPO = PYPROJECT.parent
_TORCH_LINE = re.compile(r"pip install (torch==\S+) (torchvision==\S+) (torchaudio==\S+) --index-url (\S+)")


def _documented_torch_lines() -> list[tuple[str, re.Match]]:
    found = []
    for doc in ("README.md", "docs/INSTALL.md"):
        for m in _TORCH_LINE.finditer((REPO / doc).read_text()):
            found.append((doc, m))
    return found


def test_documented_torch_lines_match_the_gpu_pins_and_the_cuda13_index():
    from recipe_hacpo.preflight import TORCH_INDEX_URL

    gpu = {canonicalize_name(Requirement(r).name): Requirement(r) for r in _project()["optional-dependencies"]["gpu"]}
    lines = _documented_torch_lines()
    assert {doc for doc, _ in lines} == {"README.md", "docs/INSTALL.md"}
    for doc, m in lines:
        for pinned in m.groups()[:3]:
            req = Requirement(pinned)
            assert _pinned(req) == _pinned(gpu[canonicalize_name(req.name)]), f"{doc}: {pinned} != the gpu extra"
        assert m.group(4) == TORCH_INDEX_URL, f"{doc}: torch index {m.group(4)}; vLLM 0.24.0's wheel needs CUDA 13"


def test_no_cuda12_index_is_documented():
    for doc in ("README.md", "docs/INSTALL.md", "docs/REPRODUCE.md"):
        text = (REPO / doc).read_text()
        assert not re.search(r"whl/cu12\d", text), f"{doc} documents a CUDA 12 torch index"
        assert "R580" in text and "--check-install" in text, f"{doc}: driver floor or post-install check missing"
