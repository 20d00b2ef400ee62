"""What a background (staged) sync costs a GPU worker: one CUDA GPU, two processes, torch only.

    python benchmarks/staging_check.py            # run by gpu_check.sh; ~1 minute on an H200
    python benchmarks/staging_check.py --gib 0.25 --swap-gib 0.5   # smaller

Process 0 plays a trainer rank, process 1 a server's worker. Both use the same GPU: NCCL refuses two ranks of one
communicator on one device of one host, so each process names a host of its own (``NCCL_HOSTID``) and NCCL carries
the bytes over its socket transport (slower than NVLink or InfiniBand: the wire numbers are a floor, not a forecast).
Measured, side by side:

- ``wire``: the trainer sends ``--gib`` in 64 MiB chunks into a device staging buffer on the worker;
- ``generate`` / ``generate+receive``: the worker's bf16 matrix products (its generation) alone, then while a thread
  receives the same bytes on a side stream (what a background round does): the products' slowdown;
- ``swap``: loading a staged version of ``--swap-gib`` into the model's buffers: from device staging (a device copy)
  or from pinned host staging (a host-to-device copy): the pause a swap costs, and the memory each staging costs.

Prints ``RESULT`` lines last.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CHUNK = 64 << 20


def matmuls(n: int, a: torch.Tensor, b: torch.Tensor) -> float:
    """Seconds for ``n`` products on the current stream."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        a @ b
    torch.cuda.synchronize()
    return time.perf_counter() - start


def receive(pg: dist.ProcessGroup, staging: torch.Tensor, stream: torch.cuda.Stream | None) -> float:
    start = time.perf_counter()
    with torch.cuda.stream(stream) if stream is not None else torch.cuda.device(0):
        for offset in range(0, staging.numel(), CHUNK):
            pg.recv([staging[offset:offset + CHUNK]], 0, 0).wait(timedelta(seconds=120))
        torch.cuda.current_stream().synchronize()
    return time.perf_counter() - start


def send(pg: dist.ProcessGroup, payload: torch.Tensor) -> None:
    for offset in range(0, payload.numel(), CHUNK):
        pg.send([payload[offset:offset + CHUNK]], 1, 0).wait(timedelta(seconds=120))
    torch.cuda.synchronize()


def run(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ["NCCL_HOSTID"] = f"lfe-staging-{rank}"  # two "hosts": NCCL refuses two ranks on one device of one
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # host; its socket transport then carries the bytes
    os.environ.setdefault("NCCL_IB_DISABLE", "1")
    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=120)
    pg = dist.ProcessGroupNCCL(dist.PrefixStore("staging", store), rank, 2, opts)
    flag = torch.ones(1, device="cuda")
    pg.allreduce([flag]).wait()
    assert flag.item() == 2, flag
    nbytes = int(args.gib * (1 << 30)) // CHUNK * CHUNK
    if rank == 0:
        payload = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
        for _ in range(3):  # wire, receive beside the products, check
            send(pg, payload)
        pg.send([payload.view(torch.int32).sum(dtype=torch.int64).reshape(1)], 1, 1).wait()
        pg.barrier().wait()
        return
    staging = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    wire = receive(pg, staging, None)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    matmuls(5, a, b)
    alone = matmuls(args.products, a, b)
    side = torch.cuda.Stream()
    result: dict[str, float] = {}
    thread = threading.Thread(target=lambda buf=staging: result.update(s=receive(pg, buf, side)))
    start = time.perf_counter()
    thread.start()
    beside = matmuls(args.products, a, b)
    thread.join()
    overlap = time.perf_counter() - start
    receive(pg, staging, None)
    check = torch.empty(1, dtype=torch.int64, device="cuda")
    pg.recv([check], 0, 1).wait()
    same = bool(staging.view(torch.int32).sum(dtype=torch.int64) == check)
    pg.barrier().wait()
    flops = 2 * 8192 ** 3 * args.products
    print(f"RESULT wire: {nbytes / 2**30:.2f} GiB in {wire:.3f} s = {nbytes / wire / 1e9:.2f} GB/s (NCCL socket"
          " transport: two processes on one GPU)", flush=True)
    print(f"RESULT generate: {flops / alone / 1e12:.0f} TFLOP/s alone, {flops / beside / 1e12:.0f} TFLOP/s while a"
          f" side-stream thread received {nbytes / 2**30:.2f} GiB ({result['s']:.3f} s, whole overlap {overlap:.3f} s):"
          f" x{alone / beside:.3f} of the rate; staged bytes equal the sent ones: {same}", flush=True)
    swap_bytes = int(args.swap_gib * (1 << 30))
    del staging
    model = torch.empty(swap_bytes, dtype=torch.uint8, device="cuda")
    device_staging = torch.randint(0, 255, (swap_bytes,), dtype=torch.uint8, device="cuda")
    start = time.perf_counter()
    host_staging = torch.empty(swap_bytes, dtype=torch.uint8, pin_memory=True)
    pin_s = time.perf_counter() - start
    host_staging.copy_(device_staging)
    times: dict[str, list[float]] = {"device": [], "host": []}
    for _ in range(3):
        for name, source in (("device", device_staging), ("host", host_staging)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.copy_(source, non_blocking=True)
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    assert torch.equal(model, device_staging)
    for name in ("device", "host"):
        best = min(times[name])
        print(f"RESULT swap from {name} staging: {swap_bytes / 2**30:.2f} GiB in {best * 1e3:.1f} ms"
              f" ({swap_bytes / best / 1e9:.0f} GB/s); staging costs {swap_bytes / 2**30:.2f} GiB of"
              f" {'GPU' if name == 'device' else 'pinned host'} memory per worker"
              + (f" (pinning it took {pin_s:.2f} s, once)" if name == "host" else ""), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="bytes sent per transfer (GiB)")
    parser.add_argument("--swap-gib", type=float, default=14.2, help="a staged version's size (default: 7B in bf16)")
    parser.add_argument("--products", type=int, default=200, help="8192^3 bf16 products timed per measurement")
    parser.add_argument("--port", type=int, default=29617)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("RESULT staging check skipped: no CUDA GPU")
        return
    mp.spawn(run, args=(args.port, args), nprocs=2)


if __name__ == "__main__":
    main()
