"""Every command README.md and docs/*.md tell a user to run, run as far as a CPU machine without
models, GPUs or Slurm allows, so that a documented line cannot stop a user before it starts:

- `python -m recipe_hacpo.main ...` (in a code block, inline, or behind a run script's
  HACPO_DRY_RUN=1) composes with Hydra and passes every check made before Ray (model and data
  paths aside: none is here); with `trainer.plan_only=true` the plan is made too;
- the overrides the prose names for the trainer's command line (`key=value` spans, a shorthand
  such as `rollout.name=vllm` read under actor_rollout_ref) compose and pass the same checks, with
  the overrides of the same paragraph;
- every other `python -m recipe_hacpo.<module> ...` parses its arguments with the module's own
  parser (the module stops right after parsing);
- every `make ...` is a target `make -n` knows, in a copy of the tree;
- every `sbatch ...` / `bash run_scripts/...` line sets only variables its script reads, and its
  Hydra overrides compose with the preset it names.

What cannot run here is named in NOT_RUN with the reason. A placeholder (`<preset>`, `pair_<pair>`,
`[hydra overrides...]`, `key=value ...`) stands for PRESET or is left out.
"""

from __future__ import annotations

import functools
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PRESET = "pair_qwen3-1p7b-base_qwen3-4b-base"  # what a placeholder preset name stands for
PRESET_WITH_AGENT = {  # presets whose agents a prose override names
    "qwen3_8b_base": "pair_qwen3-4b-base_qwen3-8b-base_lora_1gpu",
}

# A documented command that is not run here, by a piece of its text, and why.
NOT_RUN = {
    "scancel ": "needs a Slurm job to signal",
    "+rollout=vllm_cpu": "needs .venv-vllm's vLLM; tests/test_vllm_tier.py runs it",
}
# A command named in prose without the arguments it needs, by its whole text, and why.
NAMED_ONLY = {
    "python -m recipe_hacpo.main": "the trainer's name (hacpo_trainer alone has no agents)",
    "python -m recipe_hacpo.wheelhouse download": "the subcommand's name; make wheelhouse runs it with its flags",
    "python -m recipe_hacpo.evaluate --backend vllm": "one flag named; the evaluate lines above give the rest",
    "python -m recipe_hacpo.agent_names": "named as what hacpo.slurm runs with the job's preset and overrides",
    "python -m recipe_hacpo.config_reference > docs/CONFIG.md": "takes no arguments; tests/test_config_reference.py "
                                                               "compares its output with docs/CONFIG.md",
}
# Prose overrides that are not a value for the command line but a pattern of one, and why.
NOT_COMPOSED = {
    "algorithm.hacpo.mode=package.module:Class": "a placeholder: the user's own method class",
    "trainer.rollout_data_dir=DIR": "a placeholder folder",
    "trainer.log_val_generations=n": "a placeholder count",
    "+algorithm.hacpo.method_options.scale=2.0": "an option of the example method class (ToyOptions)",
    "actor.shuffle=true": "named as what the checks reject in the sharing modes",
    "trainer.device=cpu": "beside rollout.name=vllm it needs .venv-vllm's vLLM; tests/test_vllm_tier.py runs that",
}
# a shorthand key in prose is read under these prefixes: the first under which the preset has its parent
SHORTHAND_PREFIXES = ("", "actor_rollout_ref.", "actor_rollout_ref.actor.")
OVERRIDE = re.compile(r"^(~|\+{0,2})[a-z_]+(\.[A-Za-z0-9_]+)+=\S+$")
PYTHON = re.compile(r"(^|/)python[0-9.]*$")
ENV_ASSIGN = re.compile(r"^[A-Z_][A-Z0-9_]*=")
EVALUATE_SCRIPT = "evaluate_export.slurm"  # evaluates and exports a run: no trainer command to compose
OURS = ("recipe_hacpo.", "make ", "sbatch ", "run_scripts/")


# --------------------------------------------------------------------------- reading the docs


def _code_lines(text: str) -> list[str]:
    """The lines of the shell code blocks (bash, sh or unlabelled), continuations joined, the body
    of a `for VAR in a b; do ... done` once per value."""
    lines = []
    for lang, block in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        if lang in ("bash", "sh", ""):
            lines += _unrolled(re.sub(r"\\\n\s*", " ", block).splitlines())
    return lines


def _unrolled(lines: list[str]) -> list[str]:
    out, loop, body = [], None, []
    for line in lines:
        head = re.match(r"\s*for (\w+) in ([^;]+); do\s*$", line)
        if head:
            loop, body = (head.group(1), head.group(2).split()), []
        elif loop and line.strip() == "done":
            out += [b.replace(f"${loop[0]}", v) for v in loop[1] for b in body]
            loop = None
        elif loop:
            body.append(line)
        else:
            out.append(line)
    return out


def _prose(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _inline_spans(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", _prose(text))


def documented_commands() -> list[tuple[str, str]]:
    """(doc, command line) of every command of the project the docs show, in code or inline."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for line in _code_lines(text) + [s for s in _inline_spans(text) if "\n" not in s]:
            line = line.strip()
            if line.startswith("#") or not any(mark in line for mark in OURS):
                continue
            if line.startswith(("make ", "python", ".venv", "bash ", "sbatch ")) or re.match(r"[A-Z_]+=", line) \
                    or re.match(r"\S+ -m recipe_hacpo", line):
                found.append((doc.name, line))
    return found


def prose_overrides() -> list[tuple[str, list[str]]]:
    """(doc, overrides) per paragraph: every inline span made of override tokens only; and each
    code line made of override tokens only (overrides to add to a trainer command)."""
    found = []
    for doc in DOCS:
        for line in _code_lines(doc.read_text()):
            if line.split() and all(OVERRIDE.match(t) for t in line.split()):
                found.append((doc.name, line.split()))
        for paragraph in re.split(r"\n\s*\n", _prose(doc.read_text())):
            spans = [s for s in re.findall(r"`([^`\n]+)`", paragraph)
                     if s.split() and all(OVERRIDE.match(t) for t in s.split())]
            tokens = [t for s in spans for t in s.split() if t not in NOT_COMPOSED]
            if tokens:
                found.append((doc.name, tokens))
    return found


def _skipped(line: str) -> str | None:
    return NAMED_ONLY.get(line) or next((why for mark, why in NOT_RUN.items() if mark in line), None)


def _simple_commands(line: str) -> list[list[str]]:
    """A line split into its simple commands (`&&`, `;`, `|`), redirections and comments dropped."""
    out, cur = [], []
    tokens = shlex.split(line, comments=True)
    skip = False
    for t in tokens:
        if skip:
            skip = False
        elif t in ("&&", ";", "|", "||"):
            out.append(cur)
            cur = []
        elif t in (">", ">>", "<", "2>"):
            skip = True
        else:
            cur.append(t)
    return [c for c in out + [cur] if c]


def _without_placeholders(args: list[str]) -> list[str]:
    """`[optional ...]` groups, `...` and `key=value` left out; `<preset>` / `pair_<pair>` made PRESET."""
    kept, depth = [], 0
    for a in args:
        if depth or (a.startswith("[") and "=" not in a):
            depth = 0 if a.endswith("]") else 1
            continue
        a = a.replace("pair_<pair>", PRESET).replace("<preset>", PRESET)
        if "..." in a or a == "key=value" or "<" in a:
            continue
        kept.append(a)
    return kept


def _split_env(argv: list[str]) -> tuple[dict, list[str]]:
    env = {}
    while argv and ENV_ASSIGN.match(argv[0]):
        key, value = argv[0].split("=", 1)
        env[key] = value
        argv = argv[1:]
    return env, argv


# --------------------------------------------------------------------------- running them


def _compose_and_check(name: str, overrides: list[str], env: dict, monkeypatch) -> None:
    """Hydra composition and every check made before Ray; with trainer.plan_only=true, the plan."""
    from helpers.compose import compose_config

    from recipe_hacpo import main as cli
    from recipe_hacpo.config import validate

    with monkeypatch.context() as m:
        for key, value in env.items():
            m.setenv(key, value)
        cfg = compose_config(name, overrides)
        if "trainer.plan_only=true" in overrides:  # the plan, then the checks (model paths aside)
            assert cli.plan_only(cfg) == 0, (name, overrides)
        else:
            validate(cfg, check_paths=False)


def _trainer_argv(argv: list[str]) -> tuple[str, list[str]]:
    """(config name, overrides) of `python -m recipe_hacpo.main ...`."""
    args = _without_placeholders(argv[argv.index("recipe_hacpo.main") + 1:])
    name = "hacpo_trainer"
    if "--config-name" in args:
        at = args.index("--config-name")
        name = args[at + 1]
        del args[at:at + 2]
    return name, [a for a in args if not a.startswith("hydra.run.dir=") and a not in ("--cfg", "job")]


class _Parsed(Exception):
    """Raised by the module's parser right after it parsed its arguments."""


def _parse_arguments(module: str, args: list[str], monkeypatch) -> str | None:
    """Runs `python -m module args` until its ArgumentParser has parsed them; why not, or None."""
    import argparse

    if module == "recipe_hacpo.agent_names":  # no parser: the names of the default config's agents
        from recipe_hacpo import agent_names

        return None if agent_names.main(args) == 0 else "agent_names failed"
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *a, **k):
        raise _Parsed(real(self, *a, **k))

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        m.setattr(sys, "argv", [module, *args])
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=False)
        except _Parsed:
            return None
        except SystemExit as exc:  # --help exits 0 after printing; a bad flag exits 2
            return None if exc.code in (0, None) else f"exit {exc.code}"
    return "the module ran without parsing arguments"


def _script_knows(script: Path, env: dict) -> list[str]:
    """The variables of `env` that neither the script, what it sources or runs, nor a config reads."""
    scripts = REPO / "run_scripts"
    read = [script, scripts / "_run_pair.sh", *(REPO / "configs").rglob("*.yaml")]
    if script.name == "hacpo.slurm":  # it sources its helpers and runs a pair script
        read += [*scripts.glob("pair_*.sh"), *(p for p in (scripts / "slurm").iterdir() if p.is_file())]
    texts = [p.read_text() for p in read]
    return [k for k in env if not any(re.search(rf"\b{k}\b", t) for t in texts)]


def _dry_run(script: Path, args: list[str], env: dict) -> list[str]:
    """The trainer command a pair script would exec (HACPO_DRY_RUN=1, run_scripts/_run_pair.sh)."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("HACPO_", "PAIR", "PRESET", "PLACEMENT", "BASELINE"))}
    proc = subprocess.run(["bash", str(script), *args], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**keep, **env, "HACPO_DRY_RUN": "1"})
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line)[0] for line in proc.stdout.splitlines()]


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A copy of the tree (tracked and untracked-but-not-ignored files) with stand-in environments."""
    dst = tmp_path_factory.mktemp("clone")
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if (REPO / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dst / rel)
    for venv in (".venv", ".venv-vllm"):
        (dst / venv / "bin").mkdir(parents=True)
        (dst / venv / ".installed").touch()
    (dst / "wheelhouse" / "gpu-cp312").mkdir(parents=True)
    (dst / "wheelhouse" / "gpu-cp312" / "requirements.txt").touch()
    return dst


def run_command(line: str, monkeypatch, clone: Path) -> None:
    """Runs one documented line as far as this machine allows; fails with the line on a problem."""
    for argv in _simple_commands(line):
        env, argv = _split_env(argv)
        if not argv:
            continue
        prog = argv[0]
        if PYTHON.search(prog) and argv[1:2] == ["-m"] and argv[2].startswith("recipe_hacpo"):
            module = argv[2]
            if module == "recipe_hacpo.main":
                _compose_and_check(*_trainer_argv(argv), env, monkeypatch)
            else:
                why = _parse_arguments(module, _without_placeholders(argv[3:]), monkeypatch)
                assert why is None, f"{line}: {why}"
        elif prog == "make":
            args = _without_placeholders(argv[1:])
            proc = subprocess.run(["make", "-n", "--no-print-directory", *args], cwd=clone, capture_output=True,
                                  text=True, timeout=120)
            assert proc.returncode == 0 and "No rule to make target" not in proc.stderr, f"{line}: {proc.stderr}"
        elif prog == "bash" and argv[1].startswith("run_scripts/"):
            script = REPO / argv[1]
            assert not _script_knows(script, env), f"{line}: {script.name} reads none of {_script_knows(script, env)}"
            dry = _dry_run(script, _without_placeholders(argv[2:]), env)
            _compose_and_check(*_trainer_argv(dry), env, monkeypatch)
        elif prog == "sbatch":
            at = next(i for i, a in enumerate(argv) if a.startswith("run_scripts/"))
            script = REPO / argv[at]
            unknown = _script_knows(script, env)
            assert not unknown, f"{line}: {script.name} reads none of {unknown}"
            if script.name == EVALUATE_SCRIPT:  # its arguments are evaluate's, beside the --out it gives
                why = _parse_arguments("recipe_hacpo.evaluate", [*_without_placeholders(argv[at + 1:]), "--out", "x"],
                                       monkeypatch)
                assert why is None, f"{line}: {why}"
                continue
            name = env.get("PRESET") or f"pair_{env['PAIR']}"
            _compose_and_check(name, _without_placeholders(argv[at + 1:]), env, monkeypatch)


# --------------------------------------------------------------------------- the tests


def _distinct_commands() -> list[tuple[str, str]]:
    """(doc, line) of every documented command to run, each line once."""
    out, seen = [], set()
    for doc, line in documented_commands():
        if not _skipped(line) and line not in seen:
            seen.add(line)
            out.append((doc, line))
    return out


def test_the_docs_hold_every_kind_of_command():
    """A change of the docs' layout that hid commands from the test below fails here."""
    kinds = {"main": 0, "module": 0, "make": 0, "script": 0}
    for _, line in _distinct_commands():
        kinds["main" if "recipe_hacpo.main" in line else "module" if "-m recipe_hacpo" in line else
              "make" if line.startswith("make") else "script"] += 1
    assert kinds["main"] >= 8 and kinds["module"] >= 10 and kinds["make"] >= 10 and kinds["script"] >= 8, kinds


# the commands in two halves, so that the quick tier's two processes share them
@pytest.mark.parametrize("half", [0, 1])
def test_every_documented_command_runs_as_far_as_this_machine_allows(monkeypatch, clone, half):
    for var in ("HACPO_MODEL_A", "HACPO_MODEL_B", "HACPO_DATA_DIR", "HACPO_OUTPUT_DIR"):
        monkeypatch.delenv(var, raising=False)
    failed = []
    for doc, line in _distinct_commands()[half::2]:
        try:
            run_command(line, monkeypatch, clone)
        except Exception as exc:
            failed.append(f"{doc}: {line}: {str(exc).strip().splitlines()[0]}")
    assert not failed, "\n".join(failed)


def test_the_prose_names_overrides():
    assert len(prose_overrides()) >= 15, prose_overrides()


@pytest.mark.parametrize("half", [0, 1])
def test_every_override_the_prose_names_composes_with_its_paragraph(monkeypatch, half):
    for var in ("HACPO_MODEL_A", "HACPO_MODEL_B", "HACPO_DATA_DIR", "HACPO_OUTPUT_DIR"):
        monkeypatch.delenv(var, raising=False)
    distinct: dict[tuple, str] = {}  # each override group once, with the first doc that names it
    for doc, tokens in prose_overrides():
        distinct.setdefault(tuple(tokens), doc)
    failed = []
    for tokens, doc in list(distinct.items())[half::2]:
        tokens = list(tokens)
        preset = next((p for agent, p in PRESET_WITH_AGENT.items() if any(agent in t for t in tokens)), PRESET)
        resolved = [_full_key(preset, t) for t in tokens]
        try:
            _compose_and_check(preset, resolved, {}, monkeypatch)
        except Exception as exc:
            failed.append(f"{doc}: {' '.join(tokens)}: {str(exc).strip().splitlines()[0]}")
    assert not failed, "\n".join(failed)


def _full_key(preset: str, token: str) -> str:
    """The override as written, or its shorthand key read under actor_rollout_ref (the first
    prefix under which the preset has the key's first part)."""
    from omegaconf import OmegaConf

    prefix, key, value = re.match(r"^(~|\+{0,2})([^=]+)=(.*)$", token).groups()
    cfg = _composed(preset)
    for under in SHORTHAND_PREFIXES:
        parent = (under + key).rsplit(".", 1)[0]
        if OmegaConf.select(cfg, parent, default=None) is not None:
            return f"{prefix}{under}{key}={value}"
    return token


@functools.lru_cache(maxsize=None)
def _composed(preset: str):
    from helpers.compose import compose_config

    return compose_config(preset)


def test_the_old_flash_attn_fallback_would_have_been_caught(monkeypatch):
    """Negative control: the form the docs had (no `++`) stops Hydra in the check above."""
    old = ["actor_rollout_ref.model.override_config.attn_implementation=sdpa",
           "actor_rollout_ref.model.use_remove_padding=false"]
    with pytest.raises(Exception, match="Could not override 'actor_rollout_ref.model.override_config.attn_implementation'"):
        _compose_and_check(PRESET, [_full_key(PRESET, t) for t in old], {}, monkeypatch)


def test_a_variable_no_script_reads_and_an_unknown_flag_are_caught(monkeypatch, clone):
    with pytest.raises(AssertionError, match="reads none of"):
        run_command("HACPO_MODLE_A=/m bash run_scripts/pair_qwen3-1p7b-base_qwen3-4b-base.sh", monkeypatch, clone)
    with pytest.raises(AssertionError, match="exit 2"):
        run_command("python -m recipe_hacpo.data.prepare --all-frm raw/ --out data/paper/", monkeypatch, clone)
    with pytest.raises(AssertionError, match="No rule|Error"):
        run_command("make venv-gpu-nonexistent", monkeypatch, clone)
