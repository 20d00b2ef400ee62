"""The server half of a round's pause lease (issue 67): a server that a trainer paused for a round ends the pause on its
own when that trainer has gone silent, if the model it holds is one whole version with a true label.

A round's ``/pause`` carries ``lease=<seconds>`` and ``round_mode=<the round's pause mode>`` (``Server.pause``; vLLM's
route ignores both). From then on every request of the trainer renews the lease: the round's weight routes, and its
watch's ``/health?watch``, asked every second while the round runs (``servers/watch.py``). When no such request is
in flight and none came for ``lease`` seconds (the trainer died, froze, or its link was cut), the server ends the
pause by what the round did to it:

- nothing loaded (paused only), or an update that finished with its label (``/finish_weight_update`` with a
  ``weight_version``, or ``/update_weight_version`` after it): the prefix and encoder caches are reset as the round's
  mode says, and the server resumes, serving that whole version under its true label;
- an update started and not labelled yet, or one that failed (``/update_weights``, ``/v1/load_lora_adapter``, a
  ``reload_weights`` answered an error): the model may be half-loaded, so the server stays paused (a warning in its
  log) until the next full push, as before.

A ``/resume`` ends the lease. An update still in flight holds it: a trainer that died mid-data leaves the update to
its own timeout (the transfer group's), which then fails it, and the server stays paused. A pause without ``lease``
(another client's) is never ended here. It runs in the API server's event loop, as part of the plugin's middleware
(``--middleware lightning_fsdp_export_plugin.swap_route``); a server without it stays paused until the next push.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi.responses import JSONResponse  # (this module runs in the vLLM API server, which serves with FastAPI)

from lightning_fsdp_export.backend.shared import PAUSE_MODES, ROUND_HEADER, SWAP_ROUTE

__all__ = ["FENCE", "LEASE", "PauseLease", "RoundFence"]

_STARTS = ("/start_weight_update", "/start_draft_weight_update")
"""Routes that begin an update: the round is a full push or a patch of a whole model (a trainer pushes every tensor
after a failed round)."""
_CHANGES = (*_STARTS, "/update_weights", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/collective_rpc")
"""Routes from which the model is not one whole labelled version until the round labels it (``/collective_rpc``: a
directory round's ``reload_weights``)."""
_LOADS = (*_CHANGES[2:], "/finish_weight_update")
"""Routes whose failure may leave the model half-loaded."""
_ROUTES = frozenset({"/pause", "/resume", "/update_weight_version", "/reset_prefix_cache", "/reset_encoder_cache",
                     "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine", "/get_world_size",
                     "/weight_checker", *_CHANGES, *_LOADS})
"""The trainer's requests during a round (each renews the lease), besides its watch's ``/health?watch``."""


class PauseLease:
    """The lease of the pause a trainer holds on this server (one per API server process: :data:`LEASE`)."""

    def __init__(self) -> None:
        self.seconds: float | None = None
        """The lease while a trainer's pause holds it, else ``None``."""
        self.mode = "wait"
        self.engine: Any = None
        self.last = 0.0  # when the trainer's last request ended
        self.in_flight = 0
        self.unlabelled = False  # an update or adapter started and its label is not set yet
        self.broken = False  # an update failed: the model may be half-loaded
        self._task: asyncio.Task[Any] | None = None

    async def around(self, request: Any, call_next: Any) -> Any:
        """Pass ``request`` on; if it is the trainer's, renew the lease and note what it did to the model."""
        path = request.url.path
        if path not in _ROUTES and not (path == "/health" and "watch" in request.query_params):
            return await call_next(request)
        labelled = False
        if path == "/finish_weight_update":
            body = await request.body()  # (Starlette keeps it for the route)
            labelled = b"weight_version" in body
        if path in _CHANGES:  # (from the request on: a trainer that dies while it runs leaves it so)
            self.unlabelled = True
        self.in_flight += 1
        try:
            response = await call_next(request)
        finally:
            self.in_flight -= 1
            self.last = time.monotonic()
        ok = response.status_code < 400
        if path == "/pause" and ok and "lease" in request.query_params:
            self._begin(request)
        elif path == "/resume" and ok:
            self.seconds = None
        elif path in _STARTS and ok:
            self.broken = False
        if path in _LOADS and not ok:
            self.broken = True
        if (path == "/finish_weight_update" and labelled or path == "/update_weight_version") and ok:
            self.unlabelled = False
        return response

    def _begin(self, request: Any) -> None:
        mode = request.query_params.get("round_mode", "wait")
        self.seconds = float(request.query_params["lease"])
        self.mode = mode if mode in PAUSE_MODES else "wait"
        self.engine = request.app.state.engine_client
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        """While a lease holds: end the pause once it ran out (see the module's docstring)."""
        from vllm.logger import init_logger

        log = init_logger("vllm.lightning_fsdp_export.lease")
        while self.seconds is not None:
            await asyncio.sleep(0.25)
            if self.seconds is None or self.in_flight or time.monotonic() - self.last < self.seconds:
                continue
            silent, self.seconds = time.monotonic() - self.last, None
            if self.broken or self.unlabelled:
                log.warning("lfe lease: the trainer that paused this server sent nothing for %.1f s, and the round"
                            " it left may have half-loaded the model: the server stays paused until the next full"
                            " push", silent)
                return
            try:
                if self.mode != "keep_old_kv":  # a round that labelled its version may not have reset them yet
                    await self.engine.reset_prefix_cache(reset_running_requests=self.mode == "keep")
                    await self.engine.reset_encoder_cache()
                await self.engine.resume_generation()
            except Exception as err:  # noqa: BLE001 - logged: the server stays paused
                log.warning("lfe lease: resuming after the trainer went silent failed: %s", err)
                return
            log.warning("lfe lease: the trainer that paused this server sent nothing for %.1f s: resumed, serving"
                        " version %s (one whole version)", silent, await self.engine.get_weight_version())


LEASE = PauseLease()


class RoundFence:
    """Which round of which trainer this server is in: a trainer's request of an earlier round than one this server
    has seen from that trainer is refused (409), never passed on (issue 67).

    A trainer gives up a request of a round when the round's watch finds the server silent (a link cut, a frozen
    process); the request itself may still be in the network, or in a stopped server's socket, and arrive once the
    link is back or the process runs again, after the trainer began the next round (measured: a link cut for a few
    seconds mid-data; the cut round's ``/update_weights`` arrived after the redo's ``/init_weight_transfer_engine``
    and held the engine in the new group with the old round's plan for the group's whole timeout, failing the redo).
    Every request of a trainer carries ``ROUND_HEADER`` (``<session>:<round>``, :func:`~..servers.http.next_round`);
    a request of another session (another trainer, a restarted one) starts the fence over; one without the header (a
    client other than this package) is never refused.
    """

    def __init__(self) -> None:
        self.session = 0
        self.round = 0

    def refuse(self, request: Any) -> Any:
        """The 409 to answer ``request`` with, or ``None`` to let it through (and note its round)."""
        path = request.url.path
        tag = request.headers.get(ROUND_HEADER)
        if tag is None or (path not in _ROUTES and path != SWAP_ROUTE):
            return None
        try:
            session, round_ = (int(part) for part in tag.split(":"))
        except ValueError:
            return None
        if session == self.session and round_ < self.round:
            return JSONResponse({"error": f"{request.method} {path} belongs to round {round_} of its trainer, which"
                                          f" has begun round {self.round} here: a request delivered late (its round"
                                          " gave it up), refused."}, status_code=409)
        self.session, self.round = session, round_  # (a later round of this trainer, or another trainer)
        return None


FENCE = RoundFence()
"""The fence of this API server process's trainer requests (one per process, as :data:`LEASE`)."""

