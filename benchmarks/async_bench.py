"""Synchronous vs asynchronous GRPO on the same task, in one run: steps per minute, trainer waiting, reward.

    python benchmarks/async_bench.py [--steps 12] [--staleness 0,1,2] [--server URL[,URL]]

Runs ``examples/grpo_async.py`` once per bound (``0`` is the synchronous loop: each step's groups generated
after the previous sync; ``K > 0`` keeps the servers generating during the step and the sync) against the
same server(s) (started once here from the example's tiny model unless ``--server``), then prints one table
with each run's figures and its ratio to the first. On a 2-core machine the trainer ranks and the server
share the cores, which bounds what overlap can win; say so when quoting the ratio.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run(steps: int, bound: int, urls: str, workdir: Path) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "examples/grpo_async.py", "--steps", str(steps), "--max-staleness",
                           str(bound), "--server", urls, "--workdir", str(workdir)], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"the example failed (max_staleness={bound}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    out = proc.stdout
    rewards = [float(r) for r in re.findall(r"mean reward ([0-9.]+)", out)]
    final = re.search(r"steps per minute ([0-9.]+)  trainer waiting ([0-9]+)%  paused per sync ([0-9]+) ms"
                      r"  sync ([0-9]+) ms", out)
    drops = re.search(r"dropped ([0-9]+)  samples across versions ([0-9]+)", out)
    assert final and drops and rewards, out[-3000:]
    return {"steps/min": float(final[1]), "trainer waiting %": float(final[2]), "paused ms/sync": float(final[3]),
            "sync ms": float(final[4]), "reward first 3": sum(rewards[:3]) / 3, "reward last 3": sum(rewards[-3:]) / 3,
            "dropped groups": float(drops[1]), "samples across versions": float(drops[2])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--staleness", default="0,1,2")
    parser.add_argument("--server", default=None)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    work = Path(tempfile.mkdtemp(prefix="async_bench_"))
    server = None
    urls = args.server
    if urls is None:
        from examples.grpo_async import start_server

        server, urls = start_server(work)
    try:
        results = {int(k): run(args.steps, int(k), urls, work) for k in args.staleness.split(",")}
    finally:
        if server is not None:
            server.kill()
    base = next(iter(results.values()))
    keys = list(base)
    print(f"| max_staleness | {' | '.join(keys)} | steps/min ratio |")
    print("|---" * (len(keys) + 2) + "|")
    for bound, r in results.items():
        print(f"| {bound} | {' | '.join(f'{r[k]:.2f}' for k in keys)} | {r['steps/min'] / base['steps/min']:.2f}x |")


if __name__ == "__main__":
    main()
