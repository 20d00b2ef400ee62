"""Our vLLM weight-transfer backends, ``gloo`` and ``staged_nccl``: loaded by the vLLM plugin
(``lightning_fsdp_export_plugin``) inside every server process, and by trainer ranks that send to them.

:mod:`.gloo` describes the protocol and re-exports both halves; :mod:`.infos` holds what the halves agree on through
vLLM's routes, :mod:`.protocol` the chunks both sides cut a round into, :mod:`.worker` and :mod:`.trainer` the two
engines, :mod:`.staged_nccl` the same staged rounds over NCCL between GPUs, and :mod:`.adapter_dirs` the adapter
directories the workers write on their hosts. Importing this package imports no engine (and no vLLM)."""
