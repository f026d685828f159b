"""The host-memory KV tier: full KV blocks kept in host RAM past the device pool, shared by the
host's workers of the same model and KV format.

Its modules: `store` (block files under one directory in /dev/shm: keyed, checksummed, written
atomically, within a byte budget with LRU eviction), `format` (a worker's KV format and its key:
what makes two workers' blocks interchangeable), `writer` (the background thread that writes
blocks off the step's path), `tier` (the worker's tier: copies a block out of the device pool
when it is cached, and into fresh device blocks on a prefix hit; its counters for `/capability`),
`publish` (a sequence's blocks written now and acknowledged, before its stream moves).
The scheduler's block manager calls it through two thin hooks (workers/kv/manager.py); the
tier's directory and budget come from the worker's configuration (`--kv-host-bytes`,
`--kv-host-dir`), created and removed by the router (server/fleet/kv_tier_dir.py)."""
