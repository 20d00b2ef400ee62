"""The server half of a staged round's swap: one request, ``POST /lfe/swap``, that the vLLM API server carries out to
the end on its own, whatever happens to the trainer that sent it.

A staged round (``Gloo(background=True)``, ``StagedNCCL``) leaves the new version in every worker's staging area while
the server generates. Its swap used to be six requests a trainer thread sent one by one (``/pause``, start, swap,
finish with the label, ``/reset_prefix_cache``, ``/resume``): a trainer that died between two of them (OOM, a killed
job, a preempted node) left the server paused until another trainer came. Here the server owns that sequence:

1. check the staging is complete (the workers join their receiving threads) while the server still generates; a
   staging that failed answers at once, nothing paused, the served version unchanged;
2. pause (the round's pause mode), load the staging, set the version label, reset the prefix cache, resume.

The sequence runs as a task of the API server's event loop, shielded from the request: a client that goes away (the
trainer died, its network went down) does not stop it, so the server is generating again as soon as its own swap is
done (its load time; no trainer timeout is involved), serving one whole version with a true label. Only a load that
failed inside the model (weights possibly half-loaded) or a refused cache reset leaves the server paused, as a
foreground round's failure does: such a model never serves.

vLLM runs it as API-server middleware (its public ``--middleware`` option), installed by starting the server with
``--middleware lightning_fsdp_export_plugin.swap_route``; a trainer that finds no such route swaps step by step, as
before, and warns once. Like vLLM's own weight-transfer routes it needs ``VLLM_SERVER_DEV_MODE=1``.

The same middleware holds a trainer's foreground pause on a lease (:mod:`.server_lease`): a server paused by a
trainer that went silent resumes on its own when its model is one whole labelled version; and it answers ``/health``
with 503 while the server's engine process is stopped (:mod:`.server_health`: vLLM's own answers 200).

It also puts the server's API key (``--api-key``, else ``VLLM_API_KEY``) in front of every request that
changes the server outside the prefixes vLLM guards itself (``/v1``, ``/inference``, ...): vLLM's dev and
weight-transfer routes (``/pause``, ``/collective_rpc``, ``/init_weight_transfer_engine``, ...) and ``/lfe/swap``
(:func:`unauthorized`); reads (``GET``) stay open.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from typing import Any

from fastapi.responses import JSONResponse  # (this module runs in the vLLM API server, which serves with FastAPI)

from lightning_fsdp_export.backend.server_health import unhealthy
from lightning_fsdp_export.backend.server_lease import FENCE, LEASE
from lightning_fsdp_export.backend.shared import PAUSE_MODES, SWAP_PROTOCOL, SWAP_ROUTE, SWAP_STEPS

__all__ = ["handle", "middleware", "unauthorized"]

VLLM_GUARDED = ("/v1", "/v2", "/inference", "/cohere")
"""The prefixes vLLM's own ``--api-key`` middleware guards (its ``authenticate.GUARDED_PREFIX``; ``app.state.args``
holds its arguments: no public accessor for either. ``tests/test_vllm_contracts.py`` fails when vLLM changes them)."""

_tasks: set[asyncio.Task[Any]] = set()  # swaps running, kept referenced until they end
_lock: asyncio.Lock | None = None  # one swap at a time on a server


async def middleware(request: Any, call_next: Any) -> Any:
    """The plugin's ``swap_route``: refuse a request that needs the API key (:func:`unauthorized`), answer
    ``/lfe/swap`` (:func:`handle`), answer ``/health`` with 503 while a process of the server is stopped
    (:mod:`.server_health`), refuse a trainer's request of a round it has left (``RoundFence``), pass every other
    request through, the trainer's renewing its pause's lease
    (:mod:`.server_lease`)."""
    refused = unauthorized(request)
    if refused is not None:
        return refused
    if request.url.path == "/health":
        sick = unhealthy()
        if sick is not None:
            return sick
    late = FENCE.refuse(request)  # (a trainer's request of a round it has left: delivered late)
    if late is not None:
        return late
    if request.url.path != SWAP_ROUTE:
        return await LEASE.around(request, call_next)
    return await handle(request)


def unauthorized(request: Any) -> Any:
    """The 401 to answer ``request`` with, or ``None`` to let it through: a server started with an API key takes a
    request that changes it (any method but ``GET``, ``HEAD``, ``OPTIONS``) outside vLLM's own guarded prefixes only
    with that key (``Authorization: Bearer <key>``, compared in constant time as vLLM does)."""
    args = getattr(request.app.state, "args", None)  # vLLM's parsed arguments, as its own middleware reads them
    keys = [k for k in (getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]) if k]
    path = request.url.path
    if not keys or request.method in ("GET", "HEAD", "OPTIONS") or path.startswith(VLLM_GUARDED):
        return None
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and any(secrets.compare_digest(token.encode(), k.encode()) for k in keys):
        return None
    return JSONResponse({"error": f"{request.method} {path} changes this server (its pause, weights or version) and"
                                  " needs its API key: send 'Authorization: Bearer <key>' (RemoteVLLM(api_key=...))."},
                        status_code=401)


async def handle(request: Any) -> Any:
    """Answer one ``/lfe/swap`` request (:mod:`vllm` API server, event loop)."""
    from vllm import envs

    if not envs.VLLM_SERVER_DEV_MODE:
        return JSONResponse({"error": f"{SWAP_ROUTE} is a weight-transfer route: start the server with"
                                      " VLLM_SERVER_DEV_MODE=1, as every weight-sync route needs."}, status_code=404)
    if request.method == "GET":
        return JSONResponse({"protocol": SWAP_PROTOCOL, "steps": list(SWAP_STEPS)})
    if request.method != "POST":
        return JSONResponse({"error": f"{SWAP_ROUTE} takes GET or POST"}, status_code=405)
    try:
        body = await request.json()
        swap = _Swap(request, **body)
    except (ValueError, TypeError) as err:
        return JSONResponse({"error": f"{SWAP_ROUTE}: bad request body: {err}"}, status_code=400)
    task = asyncio.ensure_future(swap.run())
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
    answer = await asyncio.shield(task)  # a client gone cancels this wait, never the swap
    return JSONResponse(answer)  # 200: the swap ran; ``ok`` and ``paused`` say how it ended


class _Swap:
    """One swap on this server: the staging ``check_info`` names checked, then, paused, ``update_info`` loaded,
    ``version`` set, the prefix cache reset per ``pause_mode``, resumed."""

    def __init__(self, request: Any, *, update_info: dict[str, Any], check_info: dict[str, Any], version: str,
                 pause_mode: str, hold_at: str | None = None) -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode={pause_mode!r} is not one of {PAUSE_MODES}")
        if hold_at is not None and hold_at not in SWAP_STEPS:
            raise ValueError(f"hold_at={hold_at!r} is not one of {SWAP_STEPS}")
        self.request = request
        self.engine = request.app.state.engine_client
        self.update_info, self.check_info = update_info, check_info
        self.version, self.mode, self.hold_at = str(version), pause_mode, hold_at
        self.times: dict[str, float] = {}

    async def run(self) -> dict[str, Any]:
        global _lock
        _lock = _lock or asyncio.Lock()
        async with _lock:
            return await self._run()

    async def _run(self) -> dict[str, Any]:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        engine = self.engine
        start = time.monotonic()
        try:  # 1. the staging is complete (the workers joined their threads), the server still generating
            await engine.start_weight_update()
            await engine.update_weights(WeightTransferUpdateRequest(update_info=self.check_info))
            await engine.finish_weight_update()
        except Exception as err:  # noqa: BLE001 - answered: nothing was paused, nothing loaded
            await _close(engine)
            return self._answer(False, paused=False, error=f"the staged round is not complete: {err}")
        await self._step("checked")
        await engine.pause_generation(mode="wait" if self.mode == "wait" else "keep", clear_cache=False)
        paused_at = time.monotonic()
        await self._step("paused")
        try:  # 2. the swap: a failure inside the model may leave it half-loaded, so the server stays paused
            await engine.start_weight_update()
            await engine.update_weights(WeightTransferUpdateRequest(update_info=self.update_info))
            await engine.finish_weight_update()
        except Exception as err:  # noqa: BLE001
            await _close(engine)
            return self._answer(False, paused=True, error=f"loading the staged round failed: {err}")
        await self._step("swapped")
        await engine.update_weight_version(self.version)
        await self._step("labelled")
        if self.mode != "keep_old_kv" and not await engine.reset_prefix_cache(
                reset_running_requests=self.mode == "keep"):
            return self._answer(False, paused=True, error="the prefix cache reset was refused (blocks still held);"
                                                          " cached prompts would use the old weights")
        if self.mode != "keep_old_kv":  # vision embeddings of the old weights (the pause kept every cache)
            await engine.reset_encoder_cache()
        await self._step("cache_reset")
        await engine.resume_generation()
        self.times["paused_s"] = time.monotonic() - paused_at
        await self._step("resumed")
        self.times["total_s"] = time.monotonic() - start
        return self._answer(True, paused=False)

    async def _step(self, step: str) -> None:
        """Mark ``step`` done; with ``hold_at`` naming it, wait there until the client is gone (at most 10 s) — how a
        test kills the trainer at each step of the swap without racing it."""
        self.times[step] = time.monotonic()
        if step != self.hold_at:
            return
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and not await self.request.is_disconnected():
            await asyncio.sleep(0.02)
        self.times["client_gone"] = time.monotonic()

    def _answer(self, ok: bool, *, paused: bool, error: str | None = None) -> dict[str, Any]:
        from vllm.logger import init_logger

        log = init_logger("vllm.lightning_fsdp_export.swap")
        if ok:
            log.info("lfe swap: version %s served after a pause of %.3f s", self.version, self.times["paused_s"])
        else:
            log.warning("lfe swap to version %s failed (%s): %s", self.version,
                        "the server stays paused until the next full push" if paused else "still serving", error)
        return {"ok": ok, "version": self.version, "paused": paused, "error": error,
                "paused_s": self.times.get("paused_s"), "client_gone": "client_gone" in self.times}


async def _close(engine: Any) -> None:
    """End a weight update the failure left open (our worker closes its own; vLLM's session may still be open)."""
    try:
        await engine.finish_weight_update()
    except Exception:  # noqa: BLE001 - "without a matching start": already closed
        pass
