"""The Model preparation room: FSDP1 refusal, finding the model to export, ``fully_shard``, meta materialisation,
``pretrained=`` into the shards (``docs/architecture.md``). Called by the strategy; reaches no other room but the
export's names and the phases' offload modes."""
