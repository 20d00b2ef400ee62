"""Ray places and heals the run (issue 56): a Ray cluster of 2 nodes, each its own host (``tests/hosts.py``: network
namespaces on a 192.168.x bridge), started with Ray's own ``ray start``: the head on host ``a`` (the ``trainer``
resource), a worker node on host ``b`` (the ``server`` resource). The driver (``tests/scripts/ray_fit.py``, run on
host ``a`` as a user runs theirs) starts vLLM servers as Ray actors (``lightning_fsdp_export.ray.VLLMServers``) and a
Lightning fit inside Ray Train (``TorchTrainer``, 2 workers, ``RayLazyExportFSDP2``) syncing into them through
``RemoteVLLM(servers.urls, min_servers=1)``; mid-run the servers grow from 1 to 2, a server's actor is killed (Ray
restarts it) and a trainer worker exits (Ray Train restarts the fit from its last checkpoint).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_fsdp_export.testing import save_word_tokenizer, tiny_qwen2
from tests.hosts import Hosts, hosts_or_skip
from tests.test_rollouts import within_tolerance

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 0.1  # verify's logprob gap, as the other remote tests

ray = pytest.importorskip("ray", reason="the `ray` extra (pip install 'lightning-fsdp-export[ray]')")


def ray_start(hosts: Hosts, name: str, head: str, resources: dict[str, int], temp: Path, env: dict[str, str]) -> None:
    """Ray's own ``ray start`` on host ``name`` (the head where ``name == head``), bound to the host's address."""
    cli = str(Path(sys.executable).with_name("ray"))
    common = ["--node-ip-address", hosts.address(name), "--num-cpus", "4", "--resources", json.dumps(resources),
              "--object-store-memory", str(200 * 2**20), "--disable-usage-stats"]
    if name == head:
        cmd = [cli, "start", "--head", "--port", "6379", "--include-dashboard", "false", "--temp-dir", str(temp),
               *common]
    else:
        cmd = [cli, "start", "--address", f"{hosts.address(head)}:6379", *common]
    done = subprocess.run(hosts.command(name, cmd), capture_output=True, text=True, timeout=120, env=env)
    if done.returncode:
        raise AssertionError(f"`ray start` on host {name} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                             f"{done.stderr[-3000:]}")


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    hosts = hosts_or_skip(["a", "b"])
    work = tmp_path_factory.mktemp("ray")
    model = work / "model"
    tiny_qwen2(seed=5).to(torch.bfloat16).save_pretrained(model)
    save_word_tokenizer(str(model))
    temp = Path("/tmp") / f"lfe-ray-{os.getpid()}"  # (short: Ray's socket paths must fit in 107 characters)
    # every node and the driver share a token (Ray's token authentication: across hosts, what a cluster should run)
    env = {**{k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}, "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": uuid.uuid4().hex}
    try:
        ray_start(hosts, "a", "a", {"trainer": 2}, temp, env)
        ray_start(hosts, "b", "a", {"server": 2}, temp, env)
        out = work / "result.json"
        log = work / "driver.log"
        with log.open("w") as sink:
            code = subprocess.run(hosts.command("a", [sys.executable, str(ROOT / "tests" / "scripts" / "ray_fit.py"),
                                                      "--model-dir", str(model), "--out", str(out)]),
                                  cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=900).returncode
        if code or not out.exists():
            raise AssertionError(f"ray_fit.py failed (rc={code}):\n{log.read_text()[-6000:]}")
        return json.loads(out.read_text())
    finally:
        hosts.down()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.vllm
@pytest.mark.distributed
def test_a_fit_in_ray_train_syncs_into_servers_ray_places_grows_and_heals(ray_run: dict[str, Any]) -> None:
    got = ray_run
    assert got["error"] is None, got["error"]
    assert got["server_hosts"] == ["192.168.77.2"] or len(got["server_hosts"]) == 1, got  # host b: the "server" node
    # issue 67: the servers' owner (whose death takes its server actors with it) runs on the driver's node, host a
    assert got["owner_on_driver_node"] is True, got
    first = {s["step"]: s for s in got["steps"] if s["attempt"] == 1}
    second = [s for s in got["steps"] if s["attempt"] == 2]
    one, two = first[2]["updated"]
    # Step 1: one server. scale(2) after it: the second joins at the next sync with every tensor.
    assert first[1]["updated"] == [one] and first[2]["holds"] == {one: str(first[2]["version"]),
                                                                  two: str(first[2]["version"])}, first
    # The first server's actor killed after step 3: the pool sets it aside at step 4 (the other takes the version);
    # Ray restarts the actor, its server comes back at the same URL and rejoins at step 5 with every tensor (vLLM's
    # checker: both servers hold the same tensors, bit for bit).
    assert first[4]["out"] == [one] and first[4]["updated"] == [two] and first[4]["servers_out_metric"] == 1.0, first
    assert first[5]["out"] == [] and sorted(first[5]["updated"]) == sorted([one, two]), first[5]
    assert first[5]["holds"] == {one: str(first[5]["version"]), two: str(first[5]["version"])}, first[5]
    assert first[5]["servers_equal"] is True, first[5]
    assert 0 < first[5]["death_to_every_tensor_s"] < 300, first[5]
    # A trainer worker exited after step 7: Ray Train restarted both from the last checkpoint reported; the versions
    # go on past the ones the servers took before (none pushed twice), every sync verified.
    assert second and second[0]["step"] <= 7, got["steps"]
    # (the resumed run's push at its start is the version after the highest the servers held, its first step's next)
    assert second[0]["version"] == max(s["version"] for s in first.values()) + 2, got["steps"]
    versions = [s["version"] for s in got["steps"]]
    assert versions == sorted(versions) and len(set(versions)) == len(versions), versions
    for s in got["steps"]:
        assert not s["stale"] and s["verify_diff"] is not None and s["verify_diff"] < TOLERANCE, s
    # Every consumed token carries the version that made it (scored with that version's weights), before the trainer
    # worker died and in the resumed run (whose first version is past the servers', so no label names two weights)
    for truth in (first[6]["token_truth"], got["token_truth"]):
        assert within_tolerance(truth) and truth["unscored"] == 0 and truth["spans"] > 0, truth
    assert first[4]["serving"] == [two] and sorted(first[6]["serving"]) == sorted([one, two]), first  # rollouts
    # The fit ended; both servers serve its last version, unpaused.
    assert got["servers"] == [{"url": u, "version": str(got["final_version"]), "paused": False} for u in (one, two)]
    # The owner killed alone after the fit: Ray started it again on the driver's node; the servers, gone with it,
    # came back (both, as many as it ran) and answer
    restart = got["owner_restart"]
    assert restart["old_gone_s"] < 120 and restart["count"] == 2 and len(restart["back"]) == 2, restart
    assert restart["on_driver_node"] is True, restart


def test_servers_are_asked_for_clearly_and_need_ray_running() -> None:
    from lightning_fsdp_export.ray import VLLMServers

    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=rf"VLLMServers: count={bad!r} must be a whole number of servers"):
            VLLMServers("ckpt", bad)
    with pytest.raises(TypeError, match=r"VLLMServers\(args='--enable-lora --max-lora-rank 16'\) must be a list of"
                                        r" arguments, e\.g\. \['--enable-lora', '--max-lora-rank', '16'\]"):
        VLLMServers("ckpt", 1, args="--enable-lora --max-lora-rank 16")
    if not ray.is_initialized():
        with pytest.raises(RuntimeError, match=r"needs Ray: call ray\.init\(\.\.\.\) first"):
            VLLMServers("ckpt", 1)


def test_a_restarted_server_ends_what_its_last_start_left_and_takes_its_port_back() -> None:
    # Ray SIGKILLs an actor and its direct children (the reaper); what the server started may outlive them: the
    # actor's next start on that node ends that process group, and takes the same port once it is free (same URL)
    import signal
    import socket
    import time

    from lightning_fsdp_export._network import free_port
    from lightning_fsdp_export.ray import _end_group

    left = subprocess.Popen([sys.executable, "-c", "import socket, time; s = socket.socket();"
                             " s.bind(('127.0.0.1', 0)); s.listen(); print(s.getsockname()[1], flush=True);"
                             " time.sleep(600)"], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        port = int(left.stdout.readline())
        _end_group(left.pid)
        assert left.wait(timeout=10) == -signal.SIGKILL
        start = time.monotonic()
        assert free_port("127.0.0.1", port, wait=10.0) == port
        assert time.monotonic() - start < 10
        with socket.socket() as taken:  # a port someone else holds: a free one instead (after the wait)
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            held = taken.getsockname()[1]
            assert free_port("127.0.0.1", held, wait=1.0) != held
    finally:
        left.kill()
