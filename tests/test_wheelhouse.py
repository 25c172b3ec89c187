"""The offline install: a wheelhouse installs into a fresh venv with the network off.

The wheels here are made in the test (two tiny distributions); the wheelhouse of the real CPU
stack is built and installed the same way by `make venv-vllm` (a part of `make test`), and the
GPU stack's by `make wheelhouse` / `make venv-gpu` (docs/INSTALL.md).
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from recipe_hacpo import wheelhouse
from recipe_hacpo.lockfile import read_lock

PY = f"{sys.version_info.major}.{sys.version_info.minor}"


def _wheel(folder: Path, name: str, version: str, module_text: str) -> Path:
    """A minimal valid wheel of one module `name`."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": module_text.encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    out = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
    return out


def _lock(path: Path, wheels: list[Path], python: str = PY) -> Path:
    lines = [f"# target: test-cp{python.replace('.', '')} (Python {python}, x86_64-manylinux_2_31)",
             "# inputs-sha256: " + "0" * 64]
    for w in wheels:
        name, version, _ = wheelhouse.file_identity(w.name)
        lines.append(f"{name}=={version} \\\n    --hash=sha256:{wheelhouse.sha256(w)}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture()
def house(tmp_path) -> Path:
    folder = tmp_path / "house"
    folder.mkdir()
    wheels = [_wheel(folder, "hwalpha", "1.0", "VALUE = 'alpha'\n"), _wheel(folder, "hwbeta", "2.3", "VALUE = 'beta'\n")]
    lock = read_lock(_lock(tmp_path / "lock.txt", wheels))
    wheelhouse.write_listing(folder, lock, wheelhouse._files_of_lock(lock, folder, tmp_path / "lock.txt"))
    return folder


def _venv(tmp_path: Path) -> str:
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True)
    return str(tmp_path / "venv" / "bin" / "python")


def _no_network() -> list[str]:
    """A network namespace with no interface up, where this machine allows one."""
    for prefix in (["unshare", "-n"], ["unshare", "-rn"]):
        if subprocess.run(prefix + ["true"], capture_output=True).returncode == 0:
            return prefix
    pytest.skip("no network namespace can be made here (unshare -n / -rn)")


def test_a_wheelhouse_installs_into_a_fresh_venv_with_the_network_off(house, tmp_path):
    python = _venv(tmp_path)
    # pip is also pointed at an index that does not answer: the install must never ask one
    env = {**os.environ, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(_no_network() + [python, "-m", "recipe_hacpo.wheelhouse", "install", "--wheelhouse", str(house),
                                           "--python", python], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = subprocess.run([python, "-c", "import hwalpha, hwbeta; print(hwalpha.VALUE, hwbeta.VALUE)"],
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == ["alpha", "beta"]


def test_a_wheel_of_your_own_joins_the_set_and_installs_with_it(tmp_path):
    """A flash-attn built for the target's torch (a local version label, a platform tag) travels
    in the same folder, hash-listed beside the lock's wheels."""
    folder = tmp_path / "house"
    folder.mkdir()
    locked = _wheel(folder, "hwalpha", "1.0", "VALUE = 'alpha'\n")
    lock = read_lock(_lock(tmp_path / "lock.txt", [locked]))
    built = _wheel(tmp_path, "hwflash", "2.8.3", "VALUE = 'flash'\n")
    own = built.rename(tmp_path / "hwflash-2.8.3+cu13torch2.11cxx11abiTRUE-cp311-cp311-linux_x86_64.whl")
    listing = wheelhouse.assemble(lock, tmp_path / "lock.txt", folder, [own]).read_text()
    assert "hwalpha==1.0 --hash=sha256:" in listing
    assert f"hwflash==2.8.3+cu13torch2.11cxx11abiTRUE --hash=sha256:{wheelhouse.sha256(own)}" in listing
    assert (folder / own.name).is_file()
    with pytest.raises(wheelhouse.WheelhouseError, match="not a wheel"):
        wheelhouse.download(tmp_path / "lock.txt", folder, [tmp_path / "lock.txt"])


def test_a_changed_wheel_is_refused_by_its_hash(house, tmp_path):
    python = _venv(tmp_path)
    _wheel(house, "hwbeta", "2.3", "VALUE = 'tampered'\n")  # same name, other bytes
    code = wheelhouse.main(["install", "--wheelhouse", str(house), "--python", python])
    assert code == 1
    assert subprocess.run([python, "-c", "import hwbeta"], capture_output=True).returncode != 0


def test_a_wheelhouse_of_another_python_is_refused_in_one_line(tmp_path, capsys):
    folder = tmp_path / "house"
    folder.mkdir()
    w = _wheel(folder, "hwalpha", "1.0", "")
    lock = read_lock(_lock(tmp_path / "lock.txt", [w], python="3.99"))
    wheelhouse.write_listing(folder, lock, {"hwalpha": (w, wheelhouse.sha256(w))})
    assert wheelhouse.main(["install", "--wheelhouse", str(folder), "--python", sys.executable]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Python 3.99" in err and f"is Python {PY}" in err


def test_a_wheelhouse_missing_a_pin_names_it(tmp_path):
    folder = tmp_path / "house"
    folder.mkdir()
    w = _wheel(folder, "hwalpha", "1.0", "")
    other = _wheel(tmp_path, "hwgamma", "0.1", "")  # locked, but not in the folder
    lock = read_lock(_lock(tmp_path / "lock.txt", [w, other]))
    with pytest.raises(wheelhouse.WheelhouseError, match="hwgamma"):
        wheelhouse._files_of_lock(lock, folder, tmp_path / "lock.txt")
    assert wheelhouse.main(["install", "--wheelhouse", str(tmp_path / "nowhere"), "--python", sys.executable]) == 1


def test_file_names_and_the_target_flags():
    assert wheelhouse.file_identity("Antlr4-Python3_Runtime-4.9.3.tar.gz") == ("antlr4-python3-runtime", "4.9.3", "sdist")
    assert wheelhouse.file_identity("torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl") == ("torch", "2.11.0", "wheel")
    assert wheelhouse.file_identity("README.md") is None
    flags = wheelhouse._target_flags({"python": "3.12", "platform": "x86_64-manylinux_2_31"})
    platforms = [flags[i + 1] for i, f in enumerate(flags) if f == "--platform"]
    # every glibc from the target's down to manylinux2014's, and nothing newer than the target
    assert platforms[0] == "manylinux_2_31_x86_64" and "manylinux_2_17_x86_64" in platforms
    assert "manylinux2014_x86_64" in platforms and "manylinux_2_34_x86_64" not in platforms
    assert flags[flags.index("--python-version") + 1] == "312" and "cp312" in flags
