"""The engine core: requests, the continuous-batching scheduler and the paged KV-cache
block manager (pure Python, no torch)."""
