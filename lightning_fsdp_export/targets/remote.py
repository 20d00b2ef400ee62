"""A vLLM OpenAI server elsewhere, updated through a directory both sides can read.

The server must run with ``VLLM_SERVER_DEV_MODE=1`` (it enables ``/collective_rpc``, ``/pause``,
``/resume``, ``/reset_prefix_cache``, ``/update_weight_version``). vLLM's ``--api-key`` does not guard
those routes: a dev-mode server must be reachable only from the trainers' network.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import torch
from torch import Tensor

from lightning_fsdp_export.targets.directory import DEFAULT_SHARD_BYTES, DirectoryTarget

if TYPE_CHECKING:
    import lightning.pytorch as pl


class RemoteVLLM:
    """Rank 0 writes each version as safetensors, then asks the server to load it.

    Per sync: rank 0 writes ``directory/v{version}`` (files of at most ``shard_bytes``) while the
    export runs (other ranks only take part in the gathers), then ``POST /pause?mode=wait``,
    ``/collective_rpc`` with ``reload_weights(weights_path=...)``, ``/reset_prefix_cache``,
    ``/update_weight_version`` and ``/resume``. The server repoints its model path at the version
    directory, so the current one is never deleted (``keep_last`` >= 2 keeps the previous one too).

    Args:
        base_url: the server's address, e.g. ``"http://10.0.0.5:8000"``; nothing else is contacted.
        directory: a directory the server can read at the same path.
        api_key: sent as ``Authorization: Bearer ...`` when set (the server's ``--api-key``).
        dtype: the dtype to write; default ``torch.bfloat16``.
        timeout: seconds for each HTTP request, the load included.
        shard_bytes: the largest safetensors file written.
        keep_last: version directories kept on disk.
    """

    def __init__(self, base_url: str, *, directory: str | os.PathLike[str], api_key: str | None = None,
                 dtype: torch.dtype | None = torch.bfloat16, timeout: float = 300.0,
                 shard_bytes: int = DEFAULT_SHARD_BYTES, keep_last: int = 2) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"RemoteVLLM(base_url={base_url!r}) must look like 'http://host:port'.")
        if timeout <= 0:
            raise ValueError(f"RemoteVLLM(timeout={timeout}) must be a positive number of seconds.")
        if keep_last < 2:
            raise ValueError(f"RemoteVLLM(keep_last={keep_last}) must be at least 2: the server reads the current one.")
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self._timeout = timeout
        self._writer = DirectoryTarget(directory, dtype=dtype, shard_bytes=shard_bytes, keep_last=keep_last)
        self._is_rank_zero = True

    @property
    def dtype(self) -> torch.dtype | None:
        return self._writer.dtype

    def setup(self, trainer: pl.Trainer) -> None:
        self._writer.setup(trainer)
        self._is_rank_zero = trainer.global_rank == 0  # the server is first contacted by the first push

    def push(self, weights: Iterator[tuple[str, Tensor]], *, version: int) -> None:
        self._writer.push(weights, version=version)
        if not self._is_rank_zero:
            return
        path = os.fspath(self._writer.version_dir(version).resolve())
        self.request("POST", "/pause?mode=wait")
        try:
            self.request("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
            self.request("POST", "/reset_prefix_cache")
            self.request("POST", "/update_weight_version", {"new_version": str(version)})
        finally:
            self.request("POST", "/resume")

    def request(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        """One HTTP request to the server; raises ``ConnectionError`` naming the URL on any failure."""
        url = self.base_url + route
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self._timeout) as resp:
                text = resp.read().decode() or "null"
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:500]
            raise ConnectionError(f"vLLM server {method} {url} answered {err.code}: {detail}") from err
        except (urllib.error.URLError, OSError) as err:
            raise ConnectionError(
                f"vLLM server {method} {url} failed: {err}. Is the server up, started with VLLM_SERVER_DEV_MODE=1,"
                f" and reachable from this trainer?"
            ) from err
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    def teardown(self) -> None:
        pass
