"""Writing a store: the commit protocol of one writer shard (ShardWriter), its layouts,
and the store's identity claim. finalize (the manifest) lives in actstore.write.finalize."""

from actstore.write.identity import claim_store
from actstore.write.writer import ShardWriter

__all__ = ["ShardWriter", "claim_store"]
