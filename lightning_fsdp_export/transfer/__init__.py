"""How a push's bytes reach vLLM servers: the transports' options (:mod:`.transports`), what ``RemoteVLLM`` drives
(:mod:`.base`), the transfer group (:mod:`.frame`), one round read top to bottom (:mod:`.pipeline`), the kinds of round
(:mod:`.rounds`), pushes in the background (:mod:`.background`), adapters as sources (:mod:`.adapters`) and vLLM
0.33's patch lists (:mod:`.patch_lists`). What talks to the servers (their routes, pool, watch, pause, pre-check) is
:mod:`lightning_fsdp_export.servers`; ``targets.RemoteVLLM`` drives both; our own vLLM backend, which runs inside the
servers, is :mod:`lightning_fsdp_export.backend`."""
