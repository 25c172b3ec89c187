"""A real Slurm (Debian's slurm-wlm 22.05, munge, slurmdbd on MariaDB) on this one machine, for
tests/test_slurm.py.

Everything lives under one directory of the test's own: configuration, keys, sockets, spool,
state, the database and the logs. The daemons run in the foreground as children of the test
(no systemd); every slurmd runs in a PID namespace of its own (`unshare --pid --fork
--mount-proc`), so the batch script's Ray, its `ray stop` and everything a job starts see no
process but that node's, and ending the namespace's first process ends them all. `n` nodes
share the host (distinct names and ports, NodeAddr 127.0.0.1); each has NODE_GPUS fake GPUs, a
character device as `File=` needs, and gres.conf gives it no vendor flag, so Slurm sets every
vendor's GPU variables as it does on a cluster without `AutoDetect` (the batch script has to
clear the foreign ones).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge", "slurmdbd", "mariadb-server")
COMMANDS = ("slurmctld", "slurmd", "slurmdbd", "sbatch", "sacct", "scontrol", "munged", "mungekey",
            "mariadbd", "mariadb-install-db", "unshare", "mknod")
# logical CPUs each node declares (SlurmdParameters=config_overrides): Ray's CPUs come from srun
NODE_CPUS = 8
NODE_MEMORY_MB = 4096
# fake GPUs per node: a 1-node job splits them between two agents, a 2-node job asks for one each
NODE_GPUS = 2
# Slurm's grace between SIGTERM and SIGKILL on scancel
KILL_WAIT_S = 15


class ClusterError(RuntimeError):
    """The cluster could not be installed or brought up; the message says which part and why."""


def install() -> float:
    """apt-get install the packages when a command is missing; the seconds it took (0 if none)."""
    if all(shutil.which(c) or Path("/usr/sbin", c).exists() for c in COMMANDS):
        return 0.0
    if os.geteuid() != 0:
        raise ClusterError(f"Slurm is not installed and installing it needs root: apt-get install {' '.join(PACKAGES)}")
    start = time.monotonic()
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ClusterError(f"{' '.join(cmd)} failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
    missing = [c for c in COMMANDS if not (shutil.which(c) or Path("/usr/sbin", c).exists())]
    if missing:
        raise ClusterError(f"apt-get installed {' '.join(PACKAGES)} but {', '.join(missing)} is still missing")
    return time.monotonic() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, ready, timeout_s: float, log: Path | None = None, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.2)
    tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
    state = f"exited {proc.returncode}" if proc is not None and proc.poll() is not None else f"not ready in {timeout_s:g} s"
    raise ClusterError(f"{what}: {state}; {log}: {tail}")


class SlurmCluster:
    """munged, MariaDB, slurmdbd, slurmctld and one slurmd per node under `root`."""

    def __init__(self, root: Path, nodes: int = 2):
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.names = [f"n{i + 1}" for i in range(nodes)]
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = root / "etc" / "slurm.conf"
        self.munge_socket = root / "run" / "munge.sock"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
        self.env["SLURM_CONF"] = str(self.conf)

    # ------------------------------------------------------------------ bring-up
    def start(self) -> None:
        for sub in ("etc", "run", "log", "state", "spool", "dev", "db"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self._start_mariadb()
        self._write_slurm_conf()
        self._start("slurmdbd", ["slurmdbd", "-D"], self.root / "log" / "slurmdbd.log")
        _wait("slurmdbd", lambda: self._listening(self.dbd_port), 60, self.root / "log" / "slurmdbd.log",
              self.procs["slurmdbd"])
        self._start("slurmctld", ["slurmctld", "-D", "-c", "-i"], self.root / "log" / "slurmctld.log")
        _wait("slurmctld", lambda: self._run(["scontrol", "ping"]).returncode == 0, 60,
              self.root / "log" / "slurmctld.log", self.procs["slurmctld"])
        for name in self.names:
            log = self.root / "log" / f"slurmd-{name}.log"
            self._start(f"slurmd-{name}", ["unshare", "--pid", "--fork", "--mount-proc", "slurmd", "-D", "-N", name], log)
        _wait("slurmd (every node idle)", self._nodes_idle, 60, self.root / "log" / "slurmctld.log")

    def _start(self, name: str, argv: list[str], log: Path, env: dict | None = None) -> None:
        out = open(log.with_suffix(".out"), "w")
        self.procs[name] = subprocess.Popen(argv, env=env or self.env, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()

    def _run(self, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)

    @staticmethod
    def _listening(port: int) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            return False

    def _nodes_idle(self) -> bool:
        proc = self._run(["sinfo", "-h", "-N", "-o", "%N %t"])
        states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
        return proc.returncode == 0 and all(states.get(n) == "idle" for n in self.names)

    def _start_munge(self) -> None:
        key = self.root / "etc" / "munge.key"
        proc = subprocess.run(["mungekey", "--create", f"--keyfile={key}"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise ClusterError(f"mungekey: {proc.stderr.strip()}")
        key.chmod(0o600)
        log = self.root / "log" / "munged.log"
        self._start("munged", ["munged", "--foreground", "--force", f"--key-file={key}",
                               f"--socket={self.munge_socket}", f"--pid-file={self.root / 'run' / 'munged.pid'}",
                               f"--seed-file={self.root / 'run' / 'munge.seed'}", f"--log-file={log}"], log)
        _wait("munged", self.munge_socket.exists, 30, log, self.procs["munged"])

    def _start_mariadb(self) -> None:
        data = self.root / "db"
        log = self.root / "log" / "mariadb-install.log"
        proc = subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={data}", "--user=root",
                               "--auth-root-authentication-method=normal", "--skip-test-db"],
                              capture_output=True, text=True)
        log.write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise ClusterError(f"mariadb-install-db failed: {log}: {(proc.stdout + proc.stderr)[-1500:]}")
        self.db_port = free_port()
        err = self.root / "log" / "mariadb.err"
        # no grant tables: the database is reachable on 127.0.0.1 of this machine only, for the
        # test's own slurmdbd
        self._start("mariadb", ["mariadbd", "--no-defaults", f"--datadir={data}", "--user=root",
                                f"--socket={self.root / 'run' / 'mysql.sock'}", f"--port={self.db_port}",
                                "--bind-address=127.0.0.1", "--skip-grant-tables",
                                f"--pid-file={self.root / 'run' / 'mysql.pid'}", f"--log-error={err}"], err)
        _wait("mariadbd", lambda: self._listening(self.db_port), 60, err, self.procs["mariadb"])

    def _write_slurm_conf(self) -> None:
        r = self.root
        self.ctld_port, self.dbd_port = free_port(), free_port()
        node_ports = {name: free_port() for name in self.names}
        auth = f"socket={self.munge_socket}"
        lines = [
            "ClusterName=hacpotest",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo={auth}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'run'}/slurmd-%n.pid",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log'}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "MpiDefault=none", "SwitchType=switch/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "GresTypes=gpu",
            "ReturnToService=2",
            f"KillWait={KILL_WAIT_S}",
            # the main scheduling loop every 5 s (60 by default): a requeued job released by the
            # test starts within seconds
            "SchedulerParameters=sched_interval=5",
            "InactiveLimit=0", "MinJobAge=300",
            "AccountingStorageType=accounting_storage/slurmdbd",
            "AccountingStorageHost=127.0.0.1",
            f"AccountingStoragePort={self.dbd_port}",
            # AuthInfo does not cover the slurmctld -> slurmdbd connection
            f"AccountingStoragePass={self.munge_socket}",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
        ]
        gres = []
        for name in self.names:
            for i in range(NODE_GPUS):
                device = r / "dev" / f"{name}-gpu{i}"
                if not device.exists():
                    # a plain file is rejected: Slurm stats File= for a character device
                    subprocess.run(["mknod", str(device), "c", "1", "3"], check=True)
            lines.append(
                f"NodeName={name} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={node_ports[name]} "
                f"CPUs={NODE_CPUS} Boards=1 SocketsPerBoard=1 CoresPerSocket={NODE_CPUS} ThreadsPerCore=1 "
                f"RealMemory={NODE_MEMORY_MB} Gres=gpu:{NODE_GPUS} State=UNKNOWN"
            )
            gres.append(f"NodeName={name} Name=gpu File={r / 'dev'}/{name}-gpu[0-{NODE_GPUS - 1}]")
        lines.append(f"PartitionName=debug Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        (r / "etc" / "gres.conf").write_text("\n".join(gres) + "\n")
        dbd = r / "etc" / "slurmdbd.conf"
        dbd.write_text("\n".join([
            "AuthType=auth/munge", f"AuthInfo={auth}",
            "DbdHost=localhost", "DbdAddr=127.0.0.1", f"DbdPort={self.dbd_port}",
            "SlurmUser=root",
            "StorageType=accounting_storage/mysql", "StorageHost=127.0.0.1", f"StoragePort={self.db_port}",
            "StorageUser=root", "StorageLoc=slurm_acct_db",
            f"PidFile={r / 'run' / 'slurmdbd.pid'}", f"LogFile={r / 'log' / 'slurmdbd.log'}",
        ]) + "\n")
        dbd.chmod(0o600)  # slurmdbd refuses a readable slurmdbd.conf

    # ------------------------------------------------------------------ jobs
    def job_state(self, job: int) -> str:
        """The job's state in squeue; "" once it has left the queue. A failed squeue (a slurmctld
        busy on a loaded machine) is asked again, never read as "gone"."""
        for attempt in range(5):
            proc = self._run(["squeue", "-h", "-j", str(job), "-o", "%T"])
            if proc.returncode == 0:
                return proc.stdout.strip()
            if "Invalid job id" in proc.stderr:
                return ""
            time.sleep(1 + attempt)
        raise ClusterError(f"squeue -j {job}: {proc.stderr.strip()}")

    def wait_job(self, job: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.job_state(job) and time.monotonic() < deadline:
            time.sleep(1)
        if self.job_state(job):
            self._run(["scancel", str(job)])
            raise AssertionError(f"job {job} still {self.job_state(job)} after {timeout_s:g} s (cancelled)")

    def sacct(self, job: int, timeout_s: float = 60) -> list[tuple[str, str, str]]:
        """[(JobID, State, ExitCode)] of the job and every step, once accounting has the job's end."""
        deadline = time.monotonic() + timeout_s
        rows: list[tuple[str, str, str]] = []
        while time.monotonic() < deadline:
            proc = self._run(["sacct", "-n", "-P", "-j", str(job), "-o", "JobID,State,ExitCode"])
            rows = [tuple(line.split("|")) for line in proc.stdout.splitlines() if line.strip()]
            if rows and not any(state in ("RUNNING", "PENDING", "COMPLETING") for _, state, _ in rows):
                return rows
            time.sleep(1)
        raise AssertionError(f"sacct never showed job {job} finished: {rows}")

    def scancel(self, job: int, *options: str) -> None:
        proc = self._run(["scancel", *options, str(job)])
        if proc.returncode != 0:
            raise ClusterError(f"scancel {' '.join(options)} {job}: {proc.stderr.strip()}")

    def scontrol(self, *args: str) -> str:
        proc = self._run(["scontrol", *args])
        if proc.returncode != 0:
            raise ClusterError(f"scontrol {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def sacct_runs(self, job: int) -> list[tuple[str, str, str]]:
        """[(JobID, State, ExitCode)] of every run of the job (sacct -D: requeued runs too), batch steps included."""
        proc = self._run(["sacct", "-D", "-n", "-P", "-j", str(job), "-o", "JobID,State,ExitCode"])
        return [tuple(line.split("|")) for line in proc.stdout.splitlines() if line.strip()]

    # ------------------------------------------------------------------ processes
    def node_processes(self) -> dict[str, list[str]]:
        """{node: [command lines of every process in its slurmd's PID namespace but slurmd]}."""
        found: dict[str, list[str]] = {}
        for name in self.names:
            proc = self.procs.get(f"slurmd-{name}")
            if proc is None or proc.poll() is not None:
                found[name] = []
                continue
            found[name] = [cmd for pid, cmd in _namespace_members(proc.pid) if "slurmd" not in cmd.split()[0]]
        return found

    def node_environ(self, name: str) -> dict[str, set[str]]:
        """{node: the values of environment variable `name` among the processes of its namespace}."""
        found: dict[str, set[str]] = {}
        for node in self.names:
            proc = self.procs.get(f"slurmd-{node}")
            found[node] = set()
            for pid, _ in _namespace_members(proc.pid) if proc is not None else []:
                try:
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                prefix = f"{name}=".encode()
                found[node] |= {e[len(prefix):].decode(errors="replace") for e in environ if e.startswith(prefix)}
        return found

    def stop(self) -> list[str]:
        """Stop every daemon (slurmd first, each with its whole namespace); the ones that needed SIGKILL."""
        killed = []
        order = [f"slurmd-{n}" for n in self.names] + ["slurmctld", "slurmdbd", "mariadb", "munged"]
        for name in order:
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=20)
                killed.append(name)
        return killed

    def alive(self) -> list[str]:
        """Every process this cluster started that still runs (daemons and namespace members)."""
        left = [f"{name} ({p.pid})" for name, p in self.procs.items() if p.poll() is None]
        for name in self.names:
            p = self.procs.get(f"slurmd-{name}")
            if p is not None:
                left += [f"{name}: {cmd}" for _, cmd in _namespace_members(p.pid)]
        return left


def _namespace_members(unshare_pid: int) -> list[tuple[int, str]]:
    """Processes in the PID namespace `unshare --pid --fork` (pid `unshare_pid`) created."""
    try:
        children = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children").read_text().split()
        ns = os.readlink(f"/proc/{children[0]}/ns/pid") if children else None
    except (OSError, IndexError):
        return []
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns" / "pid") != ns:
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if cmd:
            members.append((int(entry.name), cmd))
    return members
