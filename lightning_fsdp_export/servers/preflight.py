"""What a server (or a colocated engine) must be before any tensor is sent, checked once per rendezvous.

vLLM's dev-mode ``GET /server_info?config_format=json`` returns the server's whole ``VllmConfig`` and its
vLLM version: the weight-transfer backend it was started with, its quantization, its checkpoint. A
server that cannot take this target's pushes is refused here, every problem named with the flag that
fixes it, instead of a 404, a wait for the transfer timeout, or a bare assertion half-way through a push:

* not in dev mode (``/server_info`` answers 404): ``VLLM_SERVER_DEV_MODE=1``;
* without ``--weight-transfer-config``, or with another backend than the target's transport;
* serving a quantized checkpoint (MXFP4, FP8, GPTQ, ...): the trainer sends unquantized tensors, which
  vLLM's quantized loaders either reject with a bare ``AssertionError`` or cast silently; serve the bf16
  checkpoint (as verl's GPT-OSS recipe does). Online quantization of a bf16 checkpoint
  (``--quantization fp8`` over bf16 files) loads unquantized tensors and is accepted;
* another vLLM minor than the trainer's (the weight-transfer wire formats change between minors: vLLM
  0.33's NCCL engine sends an empty ``update_info`` where 0.32's servers wait for one).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_fsdp_export.servers.http import Server, ServerError, on_all

__all__ = ["ServerInfo", "adapter_problems", "check_servers", "checkpoint_quantization", "server_info"]

# Quantization methods that only load checkpoints already stored quantized: pushing unquantized tensors into
# them is wrong whether or not rank 0 can read the server's config.json. Any other method is refused only when
# the checkpoint's config.json (readable here) says it is stored quantized.
_CHECKPOINT_ONLY = frozenset({"mxfp4", "gpt_oss_mxfp4", "gptq", "gptq_marlin", "awq", "awq_marlin", "marlin",
                              "compressed-tensors", "compressed_tensors", "bitsandbytes", "gguf", "modelopt",
                              "modelopt_fp4", "quark", "fbgemm_fp8"})


@dataclass(frozen=True)
class ServerInfo:
    """What ``/server_info`` says about one server."""

    url: str
    backend: str | None
    """The weight-transfer backend it was started with (``None``: no ``--weight-transfer-config``)."""
    quantization: str | None
    checkpoint: str
    vllm_version: str


def server_info(server: Server) -> ServerInfo:
    """``GET /server_info?config_format=json`` of ``server`` (dev mode); a 404 is named as dev mode being off."""
    try:
        info = server.config()
    except ServerError as err:
        if " answered 404" in str(err):
            raise ServerError(f"vLLM server {server.url} has its dev-mode routes off (GET /server_info answered 404):"
                              " start it with the environment variable VLLM_SERVER_DEV_MODE=1, which enables the"
                              " weight-sync routes (/pause, /init_weight_transfer_engine, /collective_rpc, ...).",
                              server.url) from err
        raise
    config = info.get("vllm_config") or {}
    model = config.get("model_config") or {}
    transfer = config.get("weight_transfer_config") or {}
    version = str((info.get("system_env") or {}).get("vllm_version") or "")
    return ServerInfo(url=server.url, backend=transfer.get("backend"), quantization=model.get("quantization"),
                      checkpoint=str(model.get("model") or ""), vllm_version=version)


def checkpoint_quantization(path: str | os.PathLike[str]) -> str | None:
    """The ``quant_method`` of the checkpoint's ``config.json`` when it is stored quantized; ``None`` when it is
    not, or when ``path`` is not a readable directory here (a hub name, another machine's path)."""
    config = Path(path) / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    quant = data.get("quantization_config") or (data.get("text_config") or {}).get("quantization_config")
    return str(quant.get("quant_method", "unknown")) if isinstance(quant, dict) else None


def quantization_problem(where: str, quantization: str | None, checkpoint: str, *,
                         stored: str | None = None) -> str | None:
    """Why ``where`` (a server or engine) cannot take unquantized pushes, or ``None`` when it can: the checkpoint
    is stored quantized (``stored``, else its ``config.json`` read here when the path is readable), or the
    method only loads stored checkpoints."""
    if quantization is None:
        return None
    stored = stored or checkpoint_quantization(checkpoint)
    if stored is None and quantization not in _CHECKPOINT_ONLY:
        return None  # online quantization of an unquantized checkpoint (or not readable here): it loads bf16
    method = stored or quantization
    return (f"{where} serves a {method}-quantized checkpoint ({checkpoint}): its quantized parameters (linear"
            f" layers, experts) load only {method} blocks and scales, and the trainer sends unquantized tensors"
            " (vLLM would fail with a bare assertion mid-push, or cast them silently). Serve the unquantized (bf16)"
            " checkpoint of the same model, as verl's GPT-OSS recipe does.")


def engine_quantization_problem(llm: Any) -> str | None:
    """:func:`quantization_problem` for an in-process ``LLM``, from the HF config its engine loaded."""
    config = llm.llm_engine.model_config
    quantization = getattr(config, "quantization", None)
    stored = quantization if getattr(config.hf_config, "quantization_config", None) is not None else None
    return quantization_problem("the colocated vLLM engine", quantization, str(config.model), stored=stored)


def check_servers(servers: Sequence[Server], *, backend: str | None) -> list[ServerInfo]:
    """Rank 0, before a rendezvous: every server in dev mode, with ``backend`` (``None``: any, for the directory
    transport), not quantized, on this vLLM's minor. Raises one :class:`ServerError` naming every problem."""
    infos = on_all(servers, server_info)
    mine = _local_vllm_version()
    problems = []
    for info in infos:
        if backend is not None and info.backend != backend:
            started = ("without --weight-transfer-config" if info.backend is None
                       else f"with the weight-transfer backend {info.backend!r}")
            problems.append(f"{info.url} was started {started}; this target sends over {backend!r}: restart it with"
                            f" --weight-transfer-config '{{\"backend\": \"{backend}\"}}'"
                            + (" (this package installed in its environment, which registers the backend)"
                               if backend == "gloo" else ""))
        quant = quantization_problem(info.url, info.quantization, info.checkpoint)
        if quant:
            problems.append(quant)
        if backend is not None and info.vllm_version and mine and _minor(info.vllm_version) != _minor(mine):
            problems.append(f"{info.url} runs vLLM {info.vllm_version} and this trainer vLLM {mine}: vLLM's weight"
                            " transfer changes its wire format between minor versions (0.33's NCCL engine sends an"
                            " empty update_info where 0.32 waits for one). Install the same vLLM minor on both sides.")
    if problems:
        raise ServerError("RemoteVLLM cannot update these servers: " + "; ".join(problems), infos[0].url)
    return infos


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def _local_vllm_version() -> str:
    try:
        import vllm
    except ImportError:
        return ""
    return str(getattr(vllm, "__version__", ""))


def adapter_problems(servers: Sequence[Server], rank: int) -> list[str]:
    """What keeps each server from loading a rank-``rank`` adapter at run time, one line per problem with its fix:
    LoRA off, a smaller ``--max-lora-rank``, or runtime updating off (its route answers 404)."""
    def check(server: Server) -> list[str]:
        info = server.config()
        lora = (info.get("vllm_config") or {}).get("lora_config")  # None without --enable-lora
        problems = []
        if not lora:
            problems.append(f"{server.url} was started without --enable-lora: restart it with --enable-lora"
                            f" --max-lora-rank {rank} (or more)")
        elif lora.get("max_lora_rank") is not None and int(lora["max_lora_rank"]) < rank:
            problems.append(f"{server.url} takes LoRA ranks up to --max-lora-rank {lora['max_lora_rank']}, and this"
                            f" adapter has rank {rank}: restart it with --max-lora-rank {rank} (or more)")
        try:  # an empty body: 400/422 from the route, or 404 without runtime updating
            server.load_adapter({})
        except ServerError as err:
            if " answered 404" in str(err):
                problems.append(f"{server.url} does not load adapters at run time (POST /v1/load_lora_adapter answered"
                                " 404): start it with the environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
        return problems

    return [line for lines in on_all(servers, check) for line in lines]
