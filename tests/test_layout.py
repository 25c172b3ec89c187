"""The folders say how the code fits together, and imports flow one way between them
(docs/DEVELOPING.md, "Where things are"): no module imports one of a layer above its own."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {"main", "evaluate", "evaluation", "export", "preflight", "warm_start", "tiny_agents", "real_tokenizers", "agent_names",
            "config_reference", "demo_report", "plugin", "fetch"}
# top first; a module may import its own layer and those below it
LAYERS = ["commands", "training", "config", "cluster", "workers", "methods", "exchange", "ground"]


def _layer(module: str) -> str:
    """The layer of a module named `recipe_hacpo.<...>`."""
    parts = module.split(".")[1:]
    if not parts:
        return "ground"
    head = parts[0]
    if head in ("training", "cluster", "workers", "methods", "exchange"):
        return head
    if head == "config":
        return "config"
    if head in COMMANDS:
        return "commands"
    return "ground"  # hacpo_settings, agent_spec, batch_keys, rollout_check, atomic_io, quiet, data, the install tools


def _modules() -> dict[str, Path]:
    found = {}
    for path in list((REPO / "recipe_hacpo").rglob("*.py")) + list((REPO / "workers").rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        parts = list(rel.parts)
        if parts[0] == "workers":
            parts = ["recipe_hacpo", *parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("recipe_hacpo"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("recipe_hacpo"))
    return out


def test_imports_flow_down_the_layers():
    modules = _modules()
    assert len(modules) > 60
    upward = []
    for name, path in modules.items():
        mine = LAYERS.index(_layer(name))
        for imported in _imports(path):
            target = next((m for m in (imported, imported.rsplit(".", 1)[0]) if m in modules), None)
            if target is not None and LAYERS.index(_layer(target)) < mine:
                upward.append(f"{name} -> {target}")
    assert not upward, "imports against the layers: " + "; ".join(sorted(upward))


def test_the_layering_check_sees_an_upward_import():
    # its negative control: a method importing the trainer would be refused
    assert LAYERS.index(_layer("recipe_hacpo.training.trainer")) < LAYERS.index(_layer("recipe_hacpo.methods.graft"))
    assert _layer("recipe_hacpo.workers.hacpo_worker") == "workers" and _layer("recipe_hacpo.batch_keys") == "ground"
