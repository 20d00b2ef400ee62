"""SLURM (issue 56): ``examples/slurm/grpo_async.sbatch`` under a real SLURM (Debian's ``slurm-wlm``: ``slurmctld``
here, one ``slurmd`` per host made of a network namespace, ``tests/hosts.py``), as a user submits it: a
heterogeneous job, the vLLM server on host ``b`` listing itself through ``python -m lightning_fsdp_export.serve``, the
2-rank trainer on host ``a`` reading that file. Skipped where SLURM is not installed (``make setup`` installs it where
apt can).

Also :mod:`lightning_fsdp_export.serve`'s own logic (the URL file, the address it binds), without a server.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_fsdp_export import serve
from tests.hosts import Hosts, hosts_or_skip

ROOT = Path(__file__).resolve().parent.parent
STEPS = 4
# `ip netns exec` mounts a sysfs of the namespace's own, without the cgroup hierarchies slurmd reads: mount the v1
# controllers there (in the namespace's own mount namespace; nothing of the machine's changes)
CGROUPS = ("mount -t tmpfs cgroups /sys/fs/cgroup && for c in cpu cpuacct cpuset memory devices freezer pids; do"
           " mkdir -p /sys/fs/cgroup/$c && mount -t cgroup -o $c cgroup /sys/fs/cgroup/$c || exit 1; done &&"
           " mkdir /sys/fs/cgroup/systemd && mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd")


def slurm_conf(path: Path, hosts: Hosts) -> None:
    """A cluster of ``hosts``' hosts, its controller on this (the root) namespace's end of their bridge."""
    state = path.parent / "slurm"
    state.mkdir(exist_ok=True)
    nodes = "\n".join(f"NodeName=host-{n} NodeAddr={hosts.address(n)} CPUs=4 RealMemory=8000" for n in hosts.names)
    path.write_text(f"""ClusterName=lfe
SlurmctldHost={socket.gethostname().split('.')[0]}({hosts.subnet}.254)
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={state}
SlurmdSpoolDir={state}/spool-%n
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd-%n.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd-%n.log
SlurmctldPort=6917
SlurmdPort=6918
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
SchedulerParameters=bf_interval=1
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
{nodes}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")


@pytest.fixture(scope="module")
def slurm_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if shutil.which("slurmctld") is None or shutil.which("slurmd") is None:
        pytest.skip("SLURM is not installed (Debian: apt-get install slurm-wlm; `make setup` does where it can)")
    hosts = hosts_or_skip(["a", "b"])
    work = tmp_path_factory.mktemp("slurm")
    conf = work / "slurm.conf"
    daemons = []
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "GLOO_SOCKET_IFNAME"},
           "SLURM_CONF": str(conf)}
    try:
        slurm_conf(conf, hosts)
        daemons.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(conf)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        for name in hosts.names:
            (work / "slurm" / f"spool-host-{name}").mkdir()
            slurmd = ["sh", "-c", CGROUPS + ' && exec "$@"', "_", "slurmd", "-D", "-N", f"host-{name}", "-f", str(conf)]
            daemons.append(subprocess.Popen(hosts.command(name, slurmd), env=env,
                                            stdout=(work / f"slurmd-{name}.out").open("w"), stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                           text=True).stdout.split():
            assert time.monotonic() < deadline, "\n".join(path.read_text()[-2000:] for path in [
                work / "slurm" / "slurmctld.log", *work.glob("slurmd-*.out")])
            time.sleep(1)
        run = work / "run"
        job_env = {**env, "RUN_DIR": str(run), "STEPS": str(STEPS), "PYTHON": sys.executable,
                   "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        start = time.monotonic()
        done = subprocess.run(["sbatch", "--wait", "--output", str(work / "job.out"),
                               "examples/slurm/grpo_async.sbatch"], cwd=ROOT, env=job_env, capture_output=True,
                              text=True, timeout=900)
        return {"code": done.returncode, "seconds": time.monotonic() - start,
                "out": (work / "job.out").read_text() if (work / "job.out").exists() else done.stderr,
                "servers_log": (run / "servers.log").read_text() if (run / "servers.log").exists() else "",
                "listed_after": (run / "servers.txt").read_text() if (run / "servers.txt").exists() else None,
                "hosts": {n: hosts.address(n) for n in hosts.names}}
    finally:
        subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True)
        for daemon in daemons:
            daemon.kill()
        hosts.down()


@pytest.mark.vllm
@pytest.mark.distributed
def test_the_sbatch_example_trains_on_one_host_against_a_server_that_listed_itself_from_another(
        slurm_job: dict[str, Any]) -> None:
    got = slurm_job
    assert got["code"] == 0, got["out"][-6000:] + got["servers_log"][-3000:]
    # the server found its host's address that reaches the batch host (not the hostname's, 127.0.1.1), listed it,
    # and took it out at the end; the trainer's requests came from the other host
    listed = re.findall(r"lightning_fsdp_export\.serve: http://([\d.]+):\d+ listed in", got["servers_log"])
    assert len(listed) == 1 and listed[0] in got["hosts"].values(), got["servers_log"][-3000:]
    callers = set(re.findall(r"INFO: +([\d.]+):\d+ - \"POST /update_weights", got["servers_log"]))
    assert callers and callers <= set(got["hosts"].values()) - {listed[0]}, callers
    assert got["listed_after"] == "", got["listed_after"]
    # the trainer's steps, every one after a sync into that server (versions go up with the steps)
    versions = [int(v) for v in re.findall(r"mean reward [0-9.]+ .*\(version (\d+)\)", got["out"])]
    assert len(versions) == STEPS and versions == sorted(versions) and versions[-1] >= STEPS, got["out"][-4000:]


def test_serve_lists_and_unlists_its_url_and_binds_the_address_that_reaches_the_trainers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    listed = tmp_path / "servers.txt"
    listed.write_text("# the servers\nhttp://10.0.0.9:8000\n")
    serve._edit(listed, "http://10.0.0.7:8001", add=True)
    serve._edit(listed, "http://10.0.0.7:8001", add=True)  # (listed once)
    assert listed.read_text() == "# the servers\nhttp://10.0.0.9:8000\nhttp://10.0.0.7:8001\n"
    serve._edit(listed, "http://10.0.0.9:8000", add=False)
    assert listed.read_text() == "# the servers\nhttp://10.0.0.7:8001\n"
    monkeypatch.setenv("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")  # srun's launching node: the address reaching it
    assert serve.this_host_address() == "127.0.0.1"
    monkeypatch.delenv("SLURM_LAUNCH_NODE_IPADDR")
    assert not serve.this_host_address().startswith("127.0.1."), "the hostname's loopback address"
    command = serve.server_command(["--model", "ckpt"], "10.0.0.7", 8001)
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and command[-2:] == ["--model", "ckpt"]
    assert "lightning_fsdp_export_plugin.swap_route" in command and '{"backend": "gloo"}' in command
    with pytest.raises(SystemExit):  # no vLLM arguments: argparse's error, naming what to give
        serve.main(["--url-file", str(listed)])
