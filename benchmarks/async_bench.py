"""Synchronous vs asynchronous GRPO on the same task, in one run: steps per minute, trainer waiting, reward.

    python benchmarks/async_bench.py [--steps 12] [--staleness 0,1,2] [--server URL[,URL]]
    python benchmarks/async_bench.py --staleness 1s,1b,2s,2b   # "s": Gloo(shard_direct=True); "b": and background=True

Runs ``examples/grpo_async.py`` once per bound (``0`` is the synchronous loop: each step's groups generated
after the previous sync; ``K > 0`` keeps the servers generating during the step and the sync) against the
same server(s) (started once here from the example's tiny model unless ``--server``), then prints one table
with each run's figures and its ratio to the first; ``--svg FILE`` draws the runs' timelines (trainer rank 0's
waits, steps, syncs and the servers' pauses; each server's requests) from their own timestamps, no plotting
library needed. On a 2-core machine the trainer ranks and the server
share the cores, which bounds what overlap can win; say so when quoting the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


COLORS = {"wait": "#bbbbbb", "step": "#4c78a8", "sync": "#f58518", "in flight": "#fdd0a2", "paused": "#e45756",
          "generate": "#54a24b"}


def timeline_svg(runs: dict[str, dict[str, Any]], width: int = 1100) -> str:
    """One picture, from each run's own timestamps (``examples/grpo_async.py --timeline``): per run, trainer
    rank 0 (waiting for its batch, the step, the sync and inside it the servers' pause; under them, a background
    round's version in flight, from the sync that sent it to its swap) and one lane per server
    (each consumed group's request, from admission to its finish; concurrent ones stacked)."""
    lane, gap, left = 16, 26, 150
    span = max(ev["end"] - ev["start"] for ev in runs.values())
    scale = (width - left - 10) / span
    rows: list[str] = []
    y = 10
    for label, ev in runs.items():
        t0 = ev["start"]
        rows.append(f'<text x="4" y="{y + 12}" font-weight="bold">{label}</text>')
        y += 18

        def bar(a: float, b: float, row_y: float, kind: str, h: float = lane - 3, t0: float = t0) -> None:
            x = left + (a - t0) * scale
            rows.append(f'<rect x="{x:.1f}" y="{row_y:.1f}" width="{max(0.5, (b - a) * scale):.1f}" height="{h:.1f}"'
                        f' fill="{COLORS[kind]}"><title>{kind} {b - a:.2f} s</title></rect>')

        rows.append(f'<text x="4" y="{y + 11}">trainer rank 0</text>')
        for s in ev["steps"]:
            bar(s["fill_start"], s["fill_end"], y, "wait")
            bar(s["fill_end"], s["sync_start"], y, "step")
            bar(s["sync_start"], s["end"], y, "sync")
            if s.get("travelled"):  # a background round: the version in flight, under the steps it overlapped
                bar(s["travelled"][0], s["travelled"][1], y + lane - 2, "in flight", 4)
            if s.get("paused"):
                bar(s["paused"][0], s["paused"][1], y + 4, "paused", lane - 11)
        y += lane + (5 if any(s.get("travelled") for s in ev["steps"]) else 0)
        for server, requests in sorted(ev["requests"].items()):
            ends: list[float] = []  # stack concurrent requests in sub-rows
            for a, b in sorted(requests):
                row = next((i for i, e in enumerate(ends) if e <= a), len(ends))
                if row < len(ends):
                    ends[row] = b
                else:
                    ends.append(b)
                bar(a, b, y + row * 4, "generate", 3)
            rows.append(f'<text x="4" y="{y + 11}">server {server.rsplit(":", 1)[-1]}</text>')
            y += max(lane, 4 * len(ends) + 4)
        y += gap
    legend = " ".join(f'<rect x="{left + i * 110}" y="{y}" width="12" height="12" fill="{c}"/>'
                      f'<text x="{left + i * 110 + 16}" y="{y + 11}">{k}</text>'
                      for i, (k, c) in enumerate(COLORS.items()))
    ticks = "".join(f'<text x="{left + t * scale:.0f}" y="{y + 30}">{t:.0f} s</text>'
                    for t in range(0, int(span) + 1, max(1, int(span) // 10)))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y + 40}" font-family="sans-serif"'
            f' font-size="11">{"".join(rows)}{legend}{ticks}</svg>')


def run(steps: int, spec: str, urls: str, workdir: Path) -> dict[str, float]:
    """One run of the example: ``spec`` is the bound, with ``s`` for shard-direct syncs (``"1s"``) or ``b`` for
    shard-direct background syncs (``"1b"``)."""
    bound, background, shards = int(spec.rstrip("bs")), spec.endswith("b"), spec[-1] in "bs"
    timeline = workdir / f"timeline_k{spec}.json"
    proc = subprocess.run([sys.executable, "examples/grpo_async.py", "--steps", str(steps), "--max-staleness",
                           str(bound), "--server", urls, "--workdir", str(workdir), "--timeline", str(timeline),
                           *(["--background"] if background else []), *(["--shard-direct"] if shards else [])],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"the example failed (max_staleness={bound}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    out = proc.stdout
    rewards = [float(r) for r in re.findall(r"mean reward ([0-9.]+)", out)]
    final = re.search(r"steps per minute ([0-9.]+)  trainer waiting ([0-9]+)%  paused per sync ([0-9]+) ms"
                      r"  sync ([0-9]+) ms", out)
    drops = re.search(r"dropped ([0-9]+)  samples across versions ([0-9]+)", out)
    assert final and drops and rewards, out[-3000:]
    label = f"max_staleness={bound}" + (", background" if background else ", shard-direct" if shards else "")
    run.timelines[label] = json.loads(timeline.read_text())  # type: ignore[attr-defined]
    return {"steps/min": float(final[1]), "trainer waiting %": float(final[2]), "paused ms/sync": float(final[3]),
            "sync ms": float(final[4]), "reward first 3": sum(rewards[:3]) / 3, "reward last 3": sum(rewards[-3:]) / 3,
            "dropped groups": float(drops[1]), "samples across versions": float(drops[2])}


run.timelines = {}  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--staleness", default="0,1,2",
                        help="bounds; '1s': K=1 with Gloo(shard_direct=True), '1b': with"
                                                            " Gloo(shard_direct=True, background=True)")
    parser.add_argument("--server", default=None)
    parser.add_argument("--svg", default=None, help="write the timeline picture here (SVG)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    work = Path(tempfile.mkdtemp(prefix="async_bench_"))
    server = None
    urls = args.server
    if urls is None:
        from examples.grpo_async import start_server

        server, urls = start_server(work)
    try:
        results = {k: run(args.steps, k, urls, work) for k in args.staleness.split(",")}
    finally:
        if server is not None:
            server.kill()
    base = next(iter(results.values()))
    keys = list(base)
    print(f"| max_staleness | {' | '.join(keys)} | steps/min ratio |")
    print("|---" * (len(keys) + 2) + "|")
    for bound, r in results.items():
        name = {"b": f"{bound[:-1]} (shard-direct, background)",
                "s": f"{bound[:-1]} (shard-direct)"}.get(bound[-1], bound)
        print(f"| {name} | {' | '.join(f'{r[k]:.2f}' for k in keys)} | {r['steps/min'] / base['steps/min']:.2f}x |")
    if args.svg:
        Path(args.svg).write_text(timeline_svg(run.timelines))  # type: ignore[attr-defined]
        print(f"timeline: {args.svg}")


if __name__ == "__main__":
    main()
