"""What a trainer and its servers share, declared once: standard library only, imported by both sides (the trainer's
transfer room; the servers' swap middleware and backend registration, inside vLLM's processes).

- the backends' names and where each half lives (:data:`BACKENDS`, registered by :func:`register_backends`, which
  the vLLM plugin ``lightning_fsdp_export_plugin`` calls in every vLLM process and a trainer calls before it builds
  a trainer engine);
- the server-owned swap: its route (:data:`SWAP_ROUTE`), the body's protocol version (:data:`SWAP_PROTOCOL`) and its
  steps (:data:`SWAP_STEPS`);
- how a round pauses a server (:data:`PauseMode`, :data:`PAUSE_MODES`) and for how long a silent trainer's pause
  holds (:data:`PAUSE_LEASE_S`);
- the header that tells a server which round of which trainer a request belongs to (:data:`ROUND_HEADER`).
"""

from __future__ import annotations

from typing import Any, Literal, get_args

__all__ = ["BACKENDS", "PAUSE_LEASE_S", "PAUSE_MODES", "ROUND_HEADER", "SWAP_PROTOCOL", "SWAP_ROUTE", "SWAP_STEPS",
           "PauseMode", "register_backends"]

_BACKEND = "lightning_fsdp_export.backend"
BACKENDS = {
    "gloo": ((f"{_BACKEND}.worker", "GlooWeightTransferEngine"),
             (f"{_BACKEND}.trainer", "GlooTrainerWeightTransferEngine")),
    "staged_nccl": ((f"{_BACKEND}.staged_nccl", "StagedNCCLWeightTransferEngine"),
                    (f"{_BACKEND}.staged_nccl", "StagedNCCLTrainerWeightTransferEngine")),
}
"""Each backend's (worker half, trainer half), as (module, class): vLLM imports a half only where it builds one."""

SWAP_ROUTE = "/lfe/swap"
"""The route of the server-owned swap (``backend.server_swap``): ``GET`` says the server can swap on its own,
``POST`` swaps."""
SWAP_PROTOCOL = 1
"""What ``GET /lfe/swap`` answers as ``protocol``: a trainer sends only the body this version reads."""
SWAP_STEPS = ("checked", "paused", "swapped", "labelled", "cache_reset", "resumed")
"""The steps of one swap, in order; a ``hold_at`` names one of them (tests only)."""

PAUSE_LEASE_S = 10.0
"""Seconds a server paused by a round waits for its trainer's next request (the round's watch asks every second) before
it ends the pause on its own, where its model is whole (``backend.server_lease``)."""

ROUND_HEADER = "X-LFE-Round"
"""``<trainer session>:<round>`` (integers: the trainer process's start, in ns, and its round count), sent with every
request of a trainer: a server refuses a request of an earlier round of the same trainer than one it has seen
(``backend.server_lease.RoundFence``): a request the trainer gave up, delivered late (a link that came back, a frozen
server that runs again), never acts on a later round."""

PauseMode = Literal["wait", "keep", "keep_old_kv"]
"""How a round pauses a server: ``wait`` drains running requests; ``keep`` freezes them (recomputed with the new
weights after the prefix-cache reset); ``keep_old_kv`` freezes them and keeps their old KV (no reset)."""
PAUSE_MODES: tuple[PauseMode, ...] = get_args(PauseMode)


def register_backends() -> None:
    """Register the worker and trainer halves of every backend with vLLM's factories (by module path: nothing of
    the backend is imported here); a repeat is a no-op."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    factories: tuple[Any, Any] = (WeightTransferEngineFactory, WeightTransferTrainerFactory)  # (two classes, one call)
    for backend, halves in BACKENDS.items():
        for factory, (module, cls) in zip(factories, halves):
            try:
                factory.register_engine(backend, module, cls)
            except ValueError as err:  # "already registered" (vLLM raises on a duplicate name)
                if "already registered" not in str(err):
                    raise
