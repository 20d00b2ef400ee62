"""How a push reaches vLLM servers: the transports' options (:mod:`.transports`), the frame of every round
(:mod:`.frame`: group, pause, failure handling), the kinds of round (:mod:`.rounds`), the pause and what a failed
round leaves (:mod:`.pauses`), pushes in the background (:mod:`.background`), the servers' HTTP routes
(:mod:`.http`), the pre-check (:mod:`.preflight`), the fan-out client (:mod:`.clients`), adapters (:mod:`.adapters`)
and vLLM 0.33's patch lists (:mod:`.patch_lists`). ``targets.RemoteVLLM`` drives it; our own vLLM backend, which
runs inside the servers, is :mod:`lightning_fsdp_export.backend`."""
