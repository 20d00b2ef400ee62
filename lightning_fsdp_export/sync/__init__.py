"""The Sync room: when to sync, which sources a sync pushes, the ranks' agreement, verify, the exact check, metrics
(``docs/architecture.md``): :class:`~.callback.VLLMWeightSync` and its parts."""
