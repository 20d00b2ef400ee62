"""One vLLM server's HTTP routes, and calling several at once; standard library only."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlsplit

__all__ = ["Server", "ServerError", "interrupt", "not_answering", "on_all", "on_each"]

T = TypeVar("T")


class ServerError(ConnectionError):
    """A request to one server failed; ``url`` names it."""

    def __init__(self, message: str, url: str) -> None:
        super().__init__(message)
        self.url = url


class Server:
    """A vLLM OpenAI server started with ``VLLM_SERVER_DEV_MODE=1`` (its weight-sync routes)."""

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

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    def __repr__(self) -> str:
        return f"Server({self.url!r})"


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
    return [result for result, _ in outcomes]  # type: ignore[misc]


def _outcomes(servers: Sequence[Server], call: Callable[[Server], T]) -> list[tuple[T | None, BaseException | None]]:
    """``call`` on every server concurrently (one server: in this thread), each one's ``(result, None)`` or
    ``(None, error)``."""
    if len(servers) == 1:
        try:
            return [(call(servers[0]), None)]
        except Exception as err:  # noqa: BLE001 - the caller decides what a failure means
            return [(None, err)]
    with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
        futures = [pool.submit(call, server) for server in servers]
    return [(None, f.exception()) if f.exception() is not None else (f.result(), None) for f in futures]


def not_answering(servers: Sequence[Server], timeout: float = 5.0) -> list[str]:
    """The URLs of the ``servers`` that do not answer ``/health`` within ``timeout`` seconds (after a failed round:
    which peer went away)."""
    silent = []
    for server in servers:
        try:
            server.request("GET", "/health", timeout=timeout)
        except ServerError:
            silent.append(server.url)
    return silent

