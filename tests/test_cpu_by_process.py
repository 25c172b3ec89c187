"""benchmarks/cpu_by_process.py: roles, and the CPU time of a process tree it follows."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("cpu_by_process", REPO / "benchmarks" / "cpu_by_process.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_roles_name_ray_actors_modules_and_scripts():
    cpu = _module()
    assert cpu.role_of(["ray::HFRolloutServer.generate", ""]) == "ray::HFRolloutServer"
    assert cpu.role_of(["ray::IDLE"]) == "ray::IDLE"
    assert cpu.role_of(["/v/bin/python", "-m", "recipe_hacpo.main", "--config-name", "x"]) == "python -m recipe_hacpo.main"
    assert cpu.role_of(["/v/bin/python", "-u", "/site/ray/_private/log_monitor.py", "--x"]) == "python log_monitor.py"
    assert cpu.role_of(["/site/ray/core/src/ray/raylet/raylet", "--raylet_socket_name=/tmp/s"]) == "raylet"
    assert cpu.role_of([]) == ""
    # a worker keeps the actor name it held, over the script Ray started it with and over IDLE
    assert cpu.better_role("python setup_worker.py", "ray::IDLE") == "ray::IDLE"
    assert cpu.better_role("ray::IDLE", "ray::HFRolloutServer") == "ray::HFRolloutServer"
    assert cpu.better_role("ray::HFRolloutServer", "ray::IDLE") == "ray::HFRolloutServer"
    assert cpu.better_role("ray::HFRolloutServer", "") == "ray::HFRolloutServer"
    assert cpu.better_role("", "python x.py") == "python x.py"


def test_a_childs_cpu_time_is_counted_under_its_own_role(tmp_path):
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"
    (tmp_path / "child_burns.py").write_text(burn.format(s=1.0))
    parent = (f"import subprocess, sys\n{burn.format(s=0.3)}"
              f"subprocess.run([sys.executable, {str(tmp_path / 'child_burns.py')!r}], check=True)\n")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cpu_by_process.py"), "--interval", "0.1",
                           "--", sys.executable, "-c", parent], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split(None, 2)[2]: float(line.split()[0]) for line in proc.stdout.splitlines()[1:-1]}
    python = Path(sys.executable).name
    assert rows[f"{python} child_burns.py"] >= 0.8, proc.stdout
    assert rows[f"{python} -c"] >= 0.2, proc.stdout
    total = float(proc.stdout.splitlines()[-1].split()[1])
    assert total >= 1.1 and "exit status 0" in proc.stdout, proc.stdout


def test_the_commands_exit_status_is_passed_on():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cpu_by_process.py"), "--",
                           sys.executable, "-c", "raise SystemExit(3)"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and "exit status 3" in proc.stdout, proc.stdout + proc.stderr
