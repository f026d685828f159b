"""The paged KV cache: block memory (`pool`), the allocator with its prefix-cache index
(`blocks`), per-sequence block tables (`manager`) over the groups of layers that attend alike
(`groups`), chained block hashes (`hashing`), the batch one model step runs over them
(`batch`), the linear-attention layers' per-sequence state (`state`), the CPU decode path's
contiguous copy of the decoding rows (`mirror`), the compiled step's attention through block
tables (`paged`) and how large the cache is on this device (`sizing`).

Below the model, not above it: the model's step reads and writes this cache (the batch it
runs over, the pool its layers write), so the model imports it; the cache knows a model only
by the three sizes it needs (`pool.KVShape`)."""
