"""What talks to the vLLM servers, whichever the transport: the typed client of a server's routes (:mod:`.http`), the
pool of servers a round updates and which it sets aside (:mod:`.pool`), rank 0's watch on them while a round runs
(:mod:`.watch`), their pause and what a failed round leaves (:mod:`.pauses`), the checks before any tensor is sent
(:mod:`.preflight`) and vLLM's weight-sync client over several servers (:mod:`.clients`). What moves the bytes (the
transports, the transfer group, the rounds) is :mod:`lightning_fsdp_export.transfer`, which hands these the servers
from the pool."""
