"""A typed client of one vLLM server (:class:`Server`: every route the trainer, its rounds and its rollouts call,
spelled here once), and calling several servers at once. Standard library only, and the swap route and pause modes
our servers share (``backend.shared``)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

from lightning_fsdp_export.backend.shared import PAUSE_LEASE_S, ROUND_HEADER, SWAP_PROTOCOL, SWAP_ROUTE, PauseMode

__all__ = ["GENERATE_ROUTE", "SILENT", "HealthProbe", "Server", "ServerError", "interrupt", "next_round",
           "not_answering", "on_all", "on_each"]

GENERATE_ROUTE = "/inference/v1/generate"
"""Token-in, token-out generation (vLLM's ``--enable-scale-out`` route): what rollouts request."""

T = TypeVar("T")

_SESSION = time.time_ns()  # this trainer process, as its servers tell it from others (ROUND_HEADER)
_ROUNDS = [0]  # the rounds this process began (every request carries the count: a server refuses an earlier round's)


def next_round() -> None:
    """A round begins: from now on this process's requests belong to it, and a server that saw them refuses any
    request of an earlier round that reaches it late (one the round gave up, delivered once a cut link came back or a
    frozen server ran again: ``backend.server_lease.RoundFence``)."""
    _ROUNDS[0] += 1


SILENT: ContextVar[Mapping[str, str] | None] = ContextVar("lfe_silent_servers", default=None)
"""While a round runs on rank 0 (``servers/watch.py``): the servers its watch found silent, by URL: why. Requests to
them that are still waited for are given up (:func:`on_each`, :func:`on_all`)."""


class ServerError(ConnectionError):
    """A request to one server failed; ``url`` names it; ``refused``: its host answered that nothing listens there."""

    def __init__(self, message: str, url: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.url = url
        self.refused = refused


class Server:
    """A vLLM OpenAI server started with ``VLLM_SERVER_DEV_MODE=1`` (its weight-sync routes): one method per route
    the package calls, each raising :class:`ServerError` naming the URL (:meth:`request` underneath)."""

    def __init__(self, base_url: str, *, api_key: str | None, timeout: float) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"RemoteVLLM(base_url={base_url!r}) must look like 'http://host:port' (or name a file"
                             " of such URLs, one per line, that exists).")
        self.url = base_url.rstrip("/")
        self.host = parts.hostname or ""
        self._api_key = api_key
        self.timeout = timeout

    def request(self, method: str, route: str, body: dict[str, Any] | None = None, *,
                timeout: float | None = None) -> Any:
        """One request; raises :class:`ServerError` naming the URL on any failure, the server's answer included."""
        url = self.url + route
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, headers=self._headers(), method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                text = resp.read().decode() or "null"
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:500]
            hint = ""
            if err.code == 404 and not route.startswith(("/v1/", "/health")):
                hint = (" (a dev-mode route: is the server started with VLLM_SERVER_DEV_MODE=1? It enables /pause,"
                        " /collective_rpc and the weight-transfer routes)")
            elif err.code == 401:
                hint = (" (the server has an API key, its --api-key or VLLM_API_KEY: pass it as"
                        " RemoteVLLM(api_key=...); with lightning_fsdp_export_plugin.swap_route loaded, the server's"
                        " weight-sync routes need it too)")
            elif err.code == 503 and "paused" in detail:
                hint = (" (the server is paused: after a failed sync it stays paused, never serving half-loaded"
                        " weights, until the next full push resumes it; vLLM >= 0.33 answers requests with 503 then)")
            raise ServerError(f"vLLM server {method} {url} answered {err.code}: {detail}{hint}", self.url) from err
        except (urllib.error.URLError, OSError) as err:
            if isinstance(getattr(err, "reason", err), ConnectionRefusedError):  # the host answered, nothing listens
                raise ServerError(
                    f"vLLM server {method} {url} failed: connection refused: no server listens there now. Its process"
                    " ended (a worker that dies, e.g. vLLM's 'Executor failed' under memory pressure, takes the server"
                    " down: see the server's own log) or it was never started on this port.", self.url,
                    refused=True) from err
            raise ServerError(
                f"vLLM server {method} {url} failed: {err}. Is the server up, started with VLLM_SERVER_DEV_MODE=1,"
                f" and reachable from this trainer?", self.url) from err
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    def post_interruptible(self, route: str, body: dict[str, Any], *, timeout: float,
                           opened: Callable[[http.client.HTTPConnection], None] | None = None,
                           sent: Callable[[], None] | None = None) -> Any:
        """A POST whose wait for the answer another thread can end at once: ``opened(connection)`` is called
        before the wait; :func:`interrupt` on that connection makes this raise :class:`ServerError`. (urllib
        gives no handle before the answer's headers arrive, and vLLM sends them only when a generation ends.)
        ``sent()`` is called once the request is on the wire, before the wait."""
        parts = urlsplit(self.url)
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = cls(parts.hostname or "", parts.port, timeout=timeout)
        try:
            conn.connect()
            if opened is not None:
                opened(conn)
            conn.request("POST", route, body=json.dumps(body).encode(), headers=self._headers())
            if sent is not None:
                sent()
            resp = conn.getresponse()
            text = resp.read().decode(errors="replace")
        except (OSError, http.client.HTTPException) as err:
            raise ServerError(f"vLLM server POST {self.url + route} failed: {err}. Is the server up and reachable"
                              " from this trainer?", self.url) from err
        finally:
            conn.close()
        if resp.status != 200:
            raise ServerError(f"vLLM server POST {self.url + route} answered {resp.status}: {text[:500]}", self.url)
        return json.loads(text)

    # -- what it serves -----------------------------------------------------------------------------------

    def health(self, *, timeout: float | None = None) -> None:
        """``GET /health``: raises unless the server answers (a round's watch asks through :class:`HealthProbe`)."""
        self.request("GET", "/health", timeout=timeout)

    def model(self) -> dict[str, Any]:
        """The served model's entry of ``GET /v1/models`` (``id``; ``root``: its checkpoint directory)."""
        return dict(self.request("GET", "/v1/models")["data"][0])

    def config(self) -> dict[str, Any]:
        """``GET /server_info`` (dev mode): the server's ``vllm_config`` and more, as JSON."""
        return dict(self.request("GET", "/server_info?config_format=json"))

    def world_size(self) -> int:
        """``GET /get_world_size``: its workers (the transfer group's members it brings)."""
        return int(self.request("GET", "/get_world_size")["world_size"])

    def weight_info(self, *, timeout: float | None = None) -> dict[str, Any]:
        """``GET /weight_info``: the version label it serves (``weight_version``)."""
        return dict(self.request("GET", "/weight_info", timeout=timeout))

    def is_paused(self, *, timeout: float | None = None) -> Any:
        """``GET /is_paused``."""
        return self.request("GET", "/is_paused", timeout=timeout)

    def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/completions``."""
        return dict(self.request("POST", "/v1/completions", body))

    def generate(self, body: dict[str, Any], *, timeout: float,
                 opened: Callable[[http.client.HTTPConnection], None] | None = None) -> Any:
        """``POST`` :data:`GENERATE_ROUTE`, a wait another thread may end (:meth:`post_interruptible`)."""
        return self.post_interruptible(GENERATE_ROUTE, body, timeout=timeout, opened=opened)

    def abort(self, request_ids: list[str], *, timeout: float | None = None) -> None:
        """Abort these generation requests (``POST /inference/v1/abort_requests``)."""
        self.request("POST", "/inference/v1/abort_requests", {"request_ids": request_ids}, timeout=timeout)

    # -- its pause, label and caches ----------------------------------------------------------------------

    def pause(self, mode: PauseMode) -> None:
        """``POST /pause``: ``wait`` drains running requests; ``keep`` and ``keep_old_kv`` freeze them and keep their KV
        (``clear_cache=false``): with ``keep`` it is recomputed after the prefix-cache reset, with ``keep_old_kv`` it
        stays (see :meth:`reset_prefix_cache`). The pause is on a lease (``backend.server_lease``): a server with our
        middleware resumes on its own, its model whole, when this trainer has sent nothing for
        :data:`~lightning_fsdp_export.backend.shared.PAUSE_LEASE_S` seconds."""
        how = "mode=wait" if mode == "wait" else "mode=keep&clear_cache=false"
        self.request("POST", f"/pause?{how}&lease={PAUSE_LEASE_S:g}&round_mode={mode}")

    def resume(self, *, timeout: float | None = None) -> None:
        """``POST /resume``."""
        self.request("POST", "/resume", timeout=timeout)

    def set_version(self, version: int) -> None:
        """``POST /update_weight_version``: its requests report ``version`` from now on."""
        self.request("POST", "/update_weight_version", {"new_version": str(version)})

    def reset_prefix_cache(self, *, running: bool = False) -> Any:
        """``POST /reset_prefix_cache`` (``running``: the frozen requests' blocks too); vLLM's answer."""
        return self.request("POST", "/reset_prefix_cache?reset_running_requests=true" if running
                            else "/reset_prefix_cache")

    def reset_encoder_cache(self) -> None:
        """``POST /reset_encoder_cache``: no image embedding of older weights stays."""
        self.request("POST", "/reset_encoder_cache")

    # -- its weights ------------------------------------------------------------------------------------

    def init_transfer(self, init_info: dict[str, Any]) -> Any:
        """``POST /init_weight_transfer_engine``: join the transfer group ``init_info`` describes."""
        return self.request("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def shutdown_transfer(self, *, timeout: float | None = None) -> None:
        """``POST /shutdown_weight_transfer_engine``."""
        self.request("POST", "/shutdown_weight_transfer_engine", timeout=timeout)

    def start_update(self, *, draft: bool = False, timeout: float | None = None) -> None:
        """``POST /start_weight_update`` (``draft``: the session goes to its speculative-decoding draft model). A
        session left open (a trainer that died between its start and its data: vLLM answers "already active") is
        closed first: its model may be half-loaded, and the round starting now, a new trainer's first or the one after
        a failure, pushes every tensor."""
        route = "/start_draft_weight_update" if draft else "/start_weight_update"
        try:
            self.request("POST", route, timeout=timeout)
        except ServerError as err:
            if "already active" not in str(err):
                raise
            self.request("POST", "/finish_weight_update", timeout=timeout)
            self.request("POST", route, timeout=timeout)

    def update(self, update_info: Any) -> None:
        """``POST /update_weights``: one round of the session."""
        self.request("POST", "/update_weights", {"update_info": update_info})

    def finish_update(self, version: str | None = None, *, timeout: float | None = None) -> None:
        """``POST /finish_weight_update``, labelling the weights ``version`` (None: unchanged)."""
        self.request("POST", "/finish_weight_update", None if version is None else {"weight_version": version},
                     timeout=timeout)

    def swap(self, body: dict[str, Any], *, sent: Callable[[], None] | None = None) -> dict[str, Any]:
        """``POST /lfe/swap``: the server swaps a staged round in on its own (``backend.server_swap``); its answer."""
        return dict(self.post_interruptible(SWAP_ROUTE, body, timeout=self.timeout, sent=sent))

    def swaps_on_its_own(self) -> bool:
        """Whether ``GET /lfe/swap`` answers our protocol (the server was started with our middleware)."""
        try:
            return bool(self.request("GET", SWAP_ROUTE).get("protocol") == SWAP_PROTOCOL)
        except (ServerError, AttributeError):
            return False

    def load_adapter(self, body: dict[str, Any]) -> None:
        """``POST /v1/load_lora_adapter`` (vLLM's runtime LoRA updating)."""
        self.request("POST", "/v1/load_lora_adapter", body)

    def reload_weights(self, path: str) -> None:
        """Every worker reloads the model from the checkpoint directory ``path`` (``/collective_rpc``)."""
        self.request("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})

    def weight_checksums(self) -> dict[str, str]:
        """vLLM's weight checker: ``{parameter: sha256}`` (``/weight_checker``)."""
        return dict(self.request("POST", "/weight_checker", {"action": "checksum"})["checksums"])

    def zero_weights(self) -> None:
        """vLLM's weight checker: every parameter zeroed (``/weight_checker`` reset)."""
        self.request("POST", "/weight_checker", {"action": "reset"})

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", ROUND_HEADER: f"{_SESSION}:{_ROUNDS[0]}"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    def __repr__(self) -> str:
        return f"Server({self.url!r})"


class HealthProbe:
    """``GET /health?watch`` to one server over one connection kept open between probes (a round's watch asks every
    second): a lossy link then costs no connection set-up per probe, whose lost SYN alone waits 1 s (then 3 s) for
    its retransmission. Raises :class:`ServerError` unless the server answers within ``timeout`` (``refused``: its
    host answered that nothing listens); a connection the server closed while idle is opened again at once."""

    def __init__(self, server: Server, timeout: float) -> None:
        self.server, self.timeout = server, timeout
        self._conn: http.client.HTTPConnection | None = None

    def __call__(self) -> None:
        for again in (False, True):
            fresh = self._conn is None
            if self._conn is None:
                parts = urlsplit(self.server.url)
                cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
                self._conn = cls(parts.hostname or "", parts.port, timeout=self.timeout)
            try:
                self._conn.request("GET", "/health?watch", headers=self.server._headers())
                resp = self._conn.getresponse()
                resp.read()
            except (OSError, http.client.HTTPException) as err:
                self.close()
                closed = isinstance(err, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError))
                if closed and not fresh and not again:
                    continue  # the server closed the kept connection (idle, or its process ended): a new one
                raise ServerError(f"vLLM server GET {self.server.url}/health?watch failed: {err}", self.server.url,
                                  refused=isinstance(err, ConnectionRefusedError)) from err
            if resp.status != 200:
                raise ServerError(f"vLLM server GET {self.server.url}/health?watch answered {resp.status}",
                                  self.server.url)
            return

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def interrupt(conn: http.client.HTTPConnection) -> None:
    """End a :meth:`Server.post_interruptible` wait from another thread (its socket shut down)."""
    if conn.sock is not None:
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def on_each(servers: Sequence[Server], call: Callable[[Server], Any]) -> dict[Server, BaseException]:
    """``call`` on every server concurrently; what failed, by server (empty: it succeeded on every one).

    For a step whose failure on one server must not decide the others' fate (resume the servers that took it)."""
    return {server: err for server, (_, err) in zip(servers, _outcomes(servers, call)) if err is not None}


def on_all(servers: Sequence[Server], call: Callable[[Server], T]) -> list[T]:
    """``call`` on every server concurrently; raises the first failure after all have answered.

    The failure names every server that failed (``ServerError.url`` is the first one's).
    """
    outcomes = _outcomes(servers, call)
    errors = [(s, err) for s, (_, err) in zip(servers, outcomes) if err is not None]
    if errors:
        first = errors[0][1]
        if len(errors) == 1:
            raise first
        lines = "; ".join(str(err) for _, err in errors)
        raise ServerError(f"{len(errors)} of {len(servers)} servers failed: {lines}", errors[0][0].url) from first
    return [cast(T, result) for result, _ in outcomes]  # (none failed: each holds its call's result)


def _outcomes(servers: Sequence[Server], call: Callable[[Server], T]) -> list[tuple[T | None, BaseException | None]]:
    """``call`` on every server concurrently (one server, no watch: in this thread), each one's ``(result, None)`` or
    ``(None, error)``. While a round's watch runs (:data:`SILENT`), a server it finds silent is not waited for: its
    outcome is a :class:`ServerError` saying so (its request is left to its own timeout, in its thread)."""
    silent = SILENT.get()
    if len(servers) == 1 and silent is None:
        try:
            return [(call(servers[0]), None)]
        except Exception as err:  # noqa: BLE001 - the caller decides what a failure means
            return [(None, err)]
    outcomes: dict[int, tuple[Any, BaseException | None]] = {}
    done = threading.Condition()

    def one(i: int, server: Server) -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (call(server), None)
        except BaseException as err:  # noqa: BLE001 - the caller decides what a failure means
            outcome = (None, err)
        with done:
            outcomes[i] = outcome
            done.notify_all()

    for i, server in enumerate(servers):  # (daemon threads: a request given up never holds the process's exit)
        threading.Thread(target=one, args=(i, server), name=f"lfe-request {server.url}", daemon=True).start()
    with done:
        while not all(i in outcomes or s.url in (silent or {}) for i, s in enumerate(servers)):
            done.wait(timeout=None if silent is None else 0.25)
        got = dict(outcomes)
    return [got[i] if i in got else
            (None, ServerError(f"vLLM server {s.url} went silent during the round ({(silent or {})[s.url]}); its"
                               " request was given up.", s.url))
            for i, s in enumerate(servers)]


def not_answering(servers: Sequence[Server], timeout: float = 5.0) -> list[str]:
    """The URLs of the ``servers`` that do not answer ``/health`` within ``timeout`` seconds (after a failed round:
    which peer went away)."""
    silent = []
    for server in servers:
        try:
            server.health(timeout=timeout)
        except ServerError:
            silent.append(server.url)
    return silent

