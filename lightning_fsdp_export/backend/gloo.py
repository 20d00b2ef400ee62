"""A ``gloo`` weight-transfer backend for vLLM: its NCCL backend's protocol, over CPU sockets.

vLLM's own backends (``nccl``, ``ipc``) need CUDA. This one runs wherever torch's gloo does, so a
CPU trainer (or a GPU trainer whose inference servers have no NCCL path to it) streams weights into
``vllm serve`` with no shared filesystem. Its two halves live in their own modules (as vLLM keeps each engine in
its own), both re-exported here; what they agree on is in :mod:`.infos` and :mod:`.protocol`:

* worker side, :class:`GlooWeightTransferEngine` (:mod:`.worker`), registered in vLLM's
  ``WeightTransferEngineFactory`` as ``"gloo"`` by the vLLM plugin ``lightning_fsdp_export_plugin``
  (an entry point in group ``vllm.general_plugins``, loaded in every vLLM process of the same
  environment); start the server with ``--weight-transfer-config '{"backend": "gloo"}'``;
* trainer side, :class:`GlooTrainerWeightTransferEngine` (:mod:`.trainer`), registered in
  ``WeightTransferTrainerFactory`` by :func:`register` (``RemoteVLLM(transport="gloo")`` does it).

The protocol follows vLLM's NCCL one: trainer rank 0 hosts a ``TCPStore`` and is rank 0 of the
transfer group, the workers of each server join from their ``rank_offset``; per round the workers
learn names, dtypes and shapes (``update_weights``), then receive the tensors in chunks of about
``packed_buffer_size_bytes``, each tensor in a fresh buffer, loaded by ``model.load_weights`` inside
vLLM's layerwise reload. Both sides cut the round into the same chunks from that update info.

Shard-direct mode (``num_trainer_ranks=T > 1``, what ``RemoteVLLM(transport=Gloo(shard_direct=True))`` uses): all T
trainer ranks are ranks ``[0, T)`` of the group, the workers follow from ``T``. A tensor the update
info gives row ``bounds`` for is sent by every trainer rank as its own rows (an FSDP2 shard, never
gathered), point to point to every worker, which assembles the full tensor; any other tensor trainer
rank 0 sends whole. With ``T=1`` rank 0 sends every tensor whole (the plain mode).

Sparse rounds (``RemoteVLLM(transport=Gloo(shard_direct=True, sparse=True))``): a round whose update info has
``keep_as`` leaves each worker a host copy of every tensor it loaded (the whole model, in the wire dtype, per
worker); a later round with ``patch_of`` naming that copy carries, per trainer rank and tensor, either its part
whole or a patch of the elements that changed, named by int32 indices or by a bitmap of the part, whichever is
smaller (:mod:`lightning_fsdp_export.export.patches`); the worker applies them
to its copy and loads the full tensors as a dense round would (vLLM 0.32 has no loader for patches), so only
the wire is sparse. A worker whose copy is not the one named fails the round; any failed round drops the copy.

Staged rounds (``RemoteVLLM(transport=Gloo(background=True))``): a round whose update info has ``stage_as`` returns
from ``update_weights`` at once; a thread of each worker receives it into host memory (whole tensors; with
``keep_as`` into the copy it keeps, patched in place by a sparse round) while the engine goes on generating, and
after the end every member all-reduces each trainer rank's byte count and CRC-32 of what it sent, which every worker
compares with what it received. A later swap round (``swap_update_info``: ``swap_to`` and no tensors), sent under
the servers' pause, loads it inside the layerwise reload. A staged round that fails touches no model.

Two additions make a failed round end instead of hang: every chunk starts with a header all-reduced
over the group (data, end, or "trainer rank r aborted": any trainer rank's failure ends the round for
every member), and after the last chunk every member all-reduces a status, so a tensor one worker
refused fails the round on every trainer rank and every worker. Every collective has ``timeout_s``; a
worker that fails finalizes the layerwise reload before it re-raises, so the next round can start.
"""


from lightning_fsdp_export.backend.infos import (
    BACKEND,
    DEFAULT_BUFFER_BYTES,
    DEFAULT_TIMEOUT_S,
    GlooTrainerInitInfo,
    GlooWeightTransferInitInfo,
    GlooWeightTransferUpdateInfo,
)
from lightning_fsdp_export.backend.trainer import (
    DENSE,
    GlooRound,
    GlooTrainerWeightTransferEngine,
    register,
    swap_update_info,
)
from lightning_fsdp_export.backend.worker import GlooWeightTransferEngine, write_adapter_dir

__all__ = ["BACKEND", "DEFAULT_BUFFER_BYTES", "DEFAULT_TIMEOUT_S", "DENSE", "GlooRound", "GlooTrainerInitInfo",
           "GlooTrainerWeightTransferEngine", "GlooWeightTransferEngine", "GlooWeightTransferInitInfo",
           "GlooWeightTransferUpdateInfo", "register", "swap_update_info", "write_adapter_dir"]
