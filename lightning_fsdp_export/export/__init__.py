"""The Export room: the exported model, its checkpoint format, the kinds of weights (``merged``, ``base``,
``adapter``) as sources, the collective gathers (``docs/architecture.md``).

Public here: :func:`lazy_export` (the per-tensor gather of any FSDP2 module, the algorithm under the strategy's
export) with its :class:`ExportReport`, and :func:`export_name` (the checkpoint name of a peft or plain parameter
name); both are also exported by the package itself.
"""

from lightning_fsdp_export.export.lazy import ExportReport, lazy_export
from lightning_fsdp_export.export.names import export_name

__all__ = ["ExportReport", "export_name", "lazy_export"]

