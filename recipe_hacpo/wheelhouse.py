"""A folder of wheels that installs a lock with no network: built where PyPI is, used where it is not.

    # on a connected machine (any OS; the wheels are chosen for the lock's target)
    python -m recipe_hacpo.wheelhouse download --lock locks/gpu-cp312.txt --dest wheelhouse/ \\
        [--wheel flash_attn-2.8.3-....whl]
    # on the node without network, in the project root
    python -m recipe_hacpo.wheelhouse install --wheelhouse wheelhouse/ --python .venv-gpu/bin/python \\
        --editable .

`download` fetches every pinned file of the lock for the lock's target (Linux x86_64, its Python)
and checks it against the lock's hashes; a package PyPI has only as source is built into a wheel
here (pure Python only when the target is another platform). Wheels given with --wheel (a
flash-attn built for the target's torch) join the set. It writes `requirements.txt` into the
folder: every file's name, version and sha256.

`install` installs exactly that set into a Python with pip's index switched off (`--no-index`,
no pip configuration read), hash-checked and without dependency resolution, then the projects
named by --editable / --local from their source trees with the build backend the set brought.
Standard library only: it runs before any environment exists.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipe_hacpo.lockfile import TARGET_LINE, canonical, read_lock  # noqa: E402

INSTALL_LIST = "requirements.txt"
# how flash-attn gets where a GPU run needs it: a prebuilt wheel for the installed torch and CUDA
# (PyPI has only its source, whose build takes nvcc and 20-30 minutes); docs/INSTALL.md
FLASH_ATTN_INSTALL = "pip install --no-deps <flash_attn-2.8.3-...whl> (docs/INSTALL.md, flash-attn)"
_WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$")
_SDIST = re.compile(r"^(?P<name>.+)-(?P<version>[^-]+)\.(tar\.gz|zip|tar\.bz2)$")


class WheelhouseError(RuntimeError):
    """A wheelhouse that cannot be made or installed: one line that says which file and why."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_identity(filename: str) -> tuple[str, str, str] | None:
    """(canonical name, version, kind) of a wheel or sdist file name; kind is "wheel" or "sdist"."""
    m = _WHEEL.match(filename)
    if m:
        return canonical(m.group("name")), m.group("version"), "wheel"
    m = _SDIST.match(filename)
    if m:
        return canonical(m.group("name")), m.group("version"), "sdist"
    return None


def _same_version(a: str, b: str) -> bool:
    strip = lambda v: re.sub(r"(\.0+)+$", "", v.lower().replace("_", "-"))  # noqa: E731
    return strip(a) == strip(b)


def _pip(python: str) -> list[str]:
    return [python, "-m", "pip", "--disable-pip-version-check"]


def _target_flags(lock: dict) -> list[str]:
    """pip's flags that pick the lock's target files instead of this machine's."""
    major, minor = lock["python"].split(".")
    arch_glibc = lock["platform"]  # x86_64-manylinux_2_28
    arch, _, tag = arch_glibc.partition("-")
    glibc_minor = int(tag.rsplit("_", 1)[1])
    flags = ["--python-version", f"{major}{minor}", "--implementation", "cp",
             "--abi", f"cp{major}{minor}", "--abi", "abi3", "--abi", "none"]
    # every manylinux tag the target accepts, newest first, and the legacy aliases of 2_17 / 2_5
    for g in range(glibc_minor, 4, -1):
        flags += ["--platform", f"manylinux_2_{g}_{arch}"]
    flags += ["--platform", f"manylinux2014_{arch}", "--platform", f"manylinux1_{arch}", "--platform", f"linux_{arch}", "--platform", "any"]
    return flags


def _host_matches(lock: dict) -> bool:
    return (f"{sys.version_info.major}.{sys.version_info.minor}" == lock["python"]
            and sysconfig.get_platform() == "linux-" + lock["platform"].split("-")[0])


def download(lock_path: Path, dest: Path, extra_wheels: list[Path], python: str = sys.executable) -> Path:
    """Fill `dest` with the lock's files for its target, hash-checked; return its requirements.txt."""
    lock = read_lock(lock_path)
    for w in extra_wheels:
        ident = file_identity(w.name)
        if not w.is_file() or ident is None or ident[2] != "wheel":
            raise WheelhouseError(f"--wheel {w}: not a wheel file")
    dest.mkdir(parents=True, exist_ok=True)
    # --no-deps: the lock is the closed set; it also lets pip take a source archive where a
    # package has no wheel, while the platform flags pick the target's wheels everywhere else
    cmd = _pip(python) + ["download", "--no-deps", "--require-hashes", "--dest", str(dest),
                          "-r", str(lock_path)] + _target_flags(lock)
    done = subprocess.run(cmd)
    if done.returncode != 0:
        raise WheelhouseError(f"pip download of {lock_path} failed (exit {done.returncode}); see pip's output above")
    return assemble(lock, lock_path, dest, extra_wheels, python)


def assemble(lock: dict, lock_path: Path, dest: Path, extra_wheels: list[Path], python: str = sys.executable) -> Path:
    """After the download: wheels for the source archives, the extra wheels, the listing."""
    files = _files_of_lock(lock, dest, lock_path)
    for name, (path, _) in list(files.items()):
        if not path.name.endswith(".whl"):
            wheel = _build_wheel(path, dest, lock, python)
            files[name] = (wheel, sha256(wheel))
    for w in extra_wheels:
        target = dest / w.name
        if w.resolve() != target.resolve():
            shutil.copy2(w, target)
        files[file_identity(w.name)[0]] = (target, sha256(target))
    out = write_listing(dest, lock, files)
    total = sum(path.stat().st_size for path, _ in files.values())
    print(f"wheelhouse {dest}: {len(files)} wheels, {total / 2**20:.0f} MiB, for {lock['target']}")
    return out


def write_listing(dest: Path, lock: dict, files: dict[str, tuple[Path, str]]) -> Path:
    """`dest/requirements.txt`: the lock's target line and each file's pin and sha256
    (`files`: {name: (path, its sha256)})."""
    lines = [f"# target: {lock['target']} (Python {lock['python']}, {lock['platform']})\n",
             "# the wheels of that lock as they lie in this folder (python -m recipe_hacpo.wheelhouse)\n"]
    for name in sorted(files):
        path, digest = files[name]
        _, version, _ = file_identity(path.name)
        lines.append(f"{name}=={version} --hash=sha256:{digest}  # {path.name}\n")
    out = dest / INSTALL_LIST
    out.write_text("".join(lines))
    return out


def _files_of_lock(lock: dict, dest: Path, lock_path: Path) -> dict[str, tuple[Path, str]]:
    """The file in `dest` for each pin of the lock whose hash the lock lists, with that hash."""
    found: dict[str, tuple[Path, str]] = {}
    wanted = {h: name for name, (_, hashes) in lock["pins"].items() for h in hashes}
    for path in dest.iterdir():
        ident = file_identity(path.name)
        if ident is None or ident[0] not in lock["pins"] or not _same_version(ident[1], lock["pins"][ident[0]][0]):
            continue
        digest = sha256(path)
        if digest in wanted:
            found[wanted[digest]] = (path, digest)
    missing = sorted(set(lock["pins"]) - set(found))
    if missing:
        raise WheelhouseError(f"{dest}: no file with a hash of {lock_path.name} for {', '.join(missing[:5])}")
    return found


def _build_wheel(sdist: Path, dest: Path, lock: dict, python: str) -> Path:
    """A wheel from a source archive of the lock (PyPI has no wheel of it)."""
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(_pip(python) + ["wheel", "--no-deps", "--wheel-dir", tmp, str(sdist)],
                              capture_output=True, text=True)
        built = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or len(built) != 1:
            raise WheelhouseError(f"{sdist.name}: building its wheel failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        wheel = built[0]
        tags = _WHEEL.match(wheel.name)
        if tags.group("plat") != "any" and not _host_matches(lock):
            raise WheelhouseError(
                f"{sdist.name}: PyPI has no wheel of it and it builds a platform wheel ({wheel.name}); build the "
                f"wheelhouse for {lock['target']} on a Linux machine with Python {lock['python']}"
            )
        target = dest / wheel.name
        shutil.move(str(wheel), target)
    return target


def install(wheelhouse: Path, python: str, editable: list[str], local: list[str]) -> None:
    """Install the wheelhouse's set, then the given source trees, with pip's index off."""
    listing = wheelhouse / INSTALL_LIST
    if not listing.is_file():
        raise WheelhouseError(f"{listing}: missing; make the wheelhouse with `python -m recipe_hacpo.wheelhouse download`")
    target = TARGET_LINE.search(listing.read_text())
    if not target:
        raise WheelhouseError(f"{listing}: no '# target:' line; not made by python -m recipe_hacpo.wheelhouse")
    version = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True).stdout.strip()
    if version != target.group(2):
        raise WheelhouseError(
            f"{wheelhouse} holds {target.group(1)} (Python {target.group(2)}) but {python} is Python {version or '?'}; "
            f"make the wheelhouse of locks/<target>-cp{version.replace('.', '')}.txt or use a Python {target.group(2)}"
        )
    env = dict(os.environ)
    for key in [k for k in env if k.startswith("PIP_")]:
        del env[key]
    # no configuration file at all: a site's pip.conf may name an index or extra find-links
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    offline = ["--no-index", "--find-links", str(wheelhouse)]
    steps = [_pip(python) + ["install", "--no-deps", "--require-hashes", "-r", str(listing)] + offline]
    for path in local:
        steps.append(_pip(python) + ["install", "--no-deps", "--no-build-isolation", path] + offline)
    for path in editable:
        steps.append(_pip(python) + ["install", "--no-deps", "--no-build-isolation", "-e", path] + offline)
    for cmd in steps:
        done = subprocess.run(cmd, env=env)
        if done.returncode != 0:
            raise WheelhouseError(f"offline install step failed (exit {done.returncode}): {' '.join(cmd[3:])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe_hacpo.wheelhouse", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("download", help="fill a folder with a lock's wheels (needs PyPI)")
    d.add_argument("--lock", required=True, type=Path, help="locks/<target>.txt")
    d.add_argument("--dest", required=True, type=Path)
    d.add_argument("--wheel", action="append", default=[], type=Path,
                   help="a wheel of your own to carry too (a flash-attn built for the target's torch)")
    i = sub.add_parser("install", help="install a wheelhouse's set with pip's index off")
    i.add_argument("--wheelhouse", required=True, type=Path)
    i.add_argument("--python", default=sys.executable, help="the Python to install into (a venv's)")
    i.add_argument("--editable", action="append", default=[], help="a source tree to install editable (the project: .)")
    i.add_argument("--local", action="append", default=[], help="a source tree to install")
    args = parser.parse_args(argv)
    try:
        if args.command == "download":
            download(args.lock, args.dest, args.wheel)
        else:
            install(args.wheelhouse, args.python, args.editable, args.local)
    except (WheelhouseError, ValueError, OSError) as exc:
        print(f"wheelhouse: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
