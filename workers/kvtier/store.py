"""Block files in one directory: the host tier's storage, shared by processes through the file system.

Design: a block is one file `<root>/<format>/<chain hash>.kvb`: a fixed header (magic, the KV
format's key, the block's chain hash, the payload's length and its XXH3-128 checksum) then the
payload, the block's K/V bytes. The checksum is non-cryptographic: it guards against corruption and
truncation (a foreign block is caught by its key and hash fields), at a fraction of a cryptographic
digest's cost, which dominated a hit's read. A file is written under a temporary name and renamed, so a reader
in another process sees a whole block or none; a read checks every header field and the digest,
and a block that fails (corrupted, truncated, another format's or another chain's) is refused and
deleted. The budget covers the whole root (every format): a write that would pass it evicts the
least recently used files first, recency being the file's mtime (set on write, bumped on each
hit), which every process sharing the root sees. Each store keeps an estimate of the bytes used
and rescans the root only when that estimate passes the budget, then evicts down to
`LOW_WATER` of it, so rescans are rare. A directory that cannot be written degrades to no tier,
with the reason kept for `/capability`. Trade-off: one file per block costs a system call per
block read or written and an inode each; it needs no shared allocator, lock or server between
processes, and a worker killed mid-write leaves at most a temporary file (swept by the next
eviction scan) rather than a torn block.
LMCache (0.5.6, a cp311 wheel downloads here) is not used: it is a vLLM/SGLang connector whose
KV transfer ops (`lmcache.cuda_ops`) link libcudart 13 and libtorch_cuda, absent from a CPU-only
torch, and it pins numpy<=2.2.6 and opentelemetry-api<=1.40, older than ours."""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import xxhash

logger = logging.getLogger(__name__)

MAGIC = b"HSKVBLK2"
_HEADER = struct.Struct("<8s32s32sQ16s")  # magic, format key, chain hash, payload bytes, XXH3-128
HEADER_BYTES = _HEADER.size
SUFFIX = ".kvb"
LOW_WATER = 0.9  # an eviction frees down to this share of the budget
RESCAN_WRITES, RESCAN_S = 64, 1.0  # the root is rescanned after this many own writes or seconds


def digest(payload: bytes | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(payload)


@dataclass(frozen=True)
class Refusal:
    """A block file that was refused (and deleted), and why."""

    path: str
    reason: str


class TierStore:
    """Blocks of one KV format (`format_key`, 32 bytes) under `root`, within `budget` bytes for
    the whole root. `enabled` False (and `reason`) when the directory cannot be written."""

    def __init__(self, root: str | Path, budget: int, format_key: bytes) -> None:
        if len(format_key) != 32:
            raise ValueError(f"A tier's `format_key` is 32 bytes, got `{len(format_key)}`")
        self.root, self.budget, self.format_key = Path(root), budget, format_key
        self.dir = self.root / format_key.hex()[:32]
        self._lock = threading.Lock()
        self.used = 0  # bytes under root, as last scanned plus this store's writes since
        self.writes_since_scan, self.scanned_at = 0, time.monotonic()
        self.written = self.hits = self.misses = self.evicted = 0
        self.refused: list[Refusal] = []
        self.write_failures, self.last_error = 0, None
        self.reason = self._open()
        self.enabled = self.reason is None

    def _open(self) -> str | None:
        """None when blocks can be written here, else why not."""
        if self.budget <= 0:
            return f"`--kv-host-bytes {self.budget}`: the host tier is off"
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            probe = self.dir / f".probe-{os.getpid()}-{threading.get_ident()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            return f"the tier directory `{self.dir}` cannot be written ({e.strerror or e}): no host tier"
        self.used = self._scan()[1]
        return None

    # -- blocks ---------------------------------------------------------------------------------

    def path(self, chain_hash: bytes) -> Path:
        return self.dir / f"{chain_hash.hex()}{SUFFIX}"

    def contains(self, chain_hash: bytes) -> bool:
        return self.enabled and self.path(chain_hash).exists()

    def put(self, chain_hash: bytes, payload: bytes | memoryview, replace: bool = False) -> bool:
        """Store one block (atomically); False when the tier is off, the block is already there
        (unless `replace`: a partly filled block's newer contents), it is larger than the whole
        budget, or the write failed (logged)."""
        if not self.enabled or len(payload) + _HEADER.size > self.budget:
            return False
        path = self.path(chain_hash)
        if path.exists() and not replace:
            return False
        size = len(payload) + _HEADER.size
        self._make_room(size)
        header = _HEADER.pack(MAGIC, self.format_key, chain_hash, len(payload), digest(payload))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:  # a full /dev/shm: the block is recomputed when needed, as without a tier
            self.write_failures += 1
            self.last_error = f"writing a block failed: {e.strerror or e}"
            (logger.warning if self.write_failures == 1 else logger.debug)("host KV tier: writing `%s` failed: %s",
                                                                          path, e)
            tmp.unlink(missing_ok=True)
            return False
        with self._lock:
            self.used += size
            self.written += 1
            self.writes_since_scan += 1
        return True

    def get(self, chain_hash: bytes) -> bytes | None:
        """The block's payload, checked against its header; None when absent or refused (a refused
        file is deleted and recorded in `refused`)."""
        payload = self._read(chain_hash, None)
        return None if payload is None else bytes(payload)

    def read_into(self, chain_hash: bytes, out: memoryview) -> bool:
        """Read the block's payload straight into `out` (a writable buffer of exactly the payload's
        length: a row of the tier's staging buffer), checked as `get` checks it; False when absent
        or refused (`out` then holds garbage)."""
        return self._read(chain_hash, out) is not None

    def _read(self, chain_hash: bytes, out) -> bytes | bytearray | memoryview | None:
        """One open, a header read, one read into the payload's buffer, a checksum, and the recency
        bump on the same descriptor."""
        if not self.enabled:
            return None
        path = self.path(chain_hash)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            self.misses += 1
            return None
        try:
            size = os.fstat(fd).st_size
            head = os.read(fd, _HEADER.size)
            why, check = self._check_header(head, chain_hash, size)
            if why is None:
                out = bytearray(size - _HEADER.size) if out is None else out
                if len(out) != size - _HEADER.size:
                    why = f"payload of {size - _HEADER.size} bytes, this format's blocks hold {len(out)}"
                elif os.readv(fd, [out]) != len(out):
                    why = "truncated while reading"
                elif digest(out) != check:
                    why = "checksum mismatch: the payload was corrupted"
            if why is None:
                try:
                    os.utime(fd)  # recency, seen by every process sharing the root
                except OSError:
                    pass
        except OSError as e:
            why = f"unreadable: {e.strerror or e}"
        finally:
            os.close(fd)
        if why is not None:
            self._refuse(path, why)
            self.misses += 1
            return None
        self.hits += 1
        return out

    def _check_header(self, head: bytes, chain_hash: bytes, size: int) -> tuple[str | None, bytes]:
        """(why the file is refused or None, the payload's checksum) from its header and size."""
        if len(head) < _HEADER.size:
            return f"truncated: {size} bytes, shorter than the {_HEADER.size}-byte header", b""
        magic, key, h, n, check = _HEADER.unpack(head)
        if magic != MAGIC:
            return f"not a block file (magic `{magic!r}`)", b""
        if key != self.format_key:
            mine = self.format_key.hex()[:16]
            return f"another KV format's block (key `{key.hex()[:16]}`, this worker's `{mine}`)", b""
        if h != chain_hash:
            return f"another chain's block (hash `{h.hex()[:16]}`)", b""
        if size - _HEADER.size != n:
            return f"payload of {size - _HEADER.size} bytes, the header says {n}", b""
        return None, check

    def _refuse(self, path: Path, why: str) -> None:
        logger.warning("host KV tier: refused `%s`: %s; deleted", path, why)
        with self._lock:
            self.refused.append(Refusal(str(path), why))
            del self.refused[:-8]
        path.unlink(missing_ok=True)

    # -- the budget -----------------------------------------------------------------------------

    def _make_room(self, size: int) -> None:
        """Evict least recently used files (by mtime, across every process) when this write would
        pass the budget by this store's estimate; then down to `LOW_WATER` of the budget."""
        if self.used + size <= self.budget and self.writes_since_scan < RESCAN_WRITES \
                and time.monotonic() - self.scanned_at < RESCAN_S:
            return
        with self._lock:
            files, used = self._scan()
            self.writes_since_scan, self.scanned_at = 0, time.monotonic()
            if used + size > self.budget:
                target = int(self.budget * LOW_WATER) - size
                for _, n, p in sorted(files):
                    if used <= target:
                        break
                    try:
                        p.unlink()
                        used -= n
                        self.evicted += 1
                    except FileNotFoundError:  # another process evicted it first
                        used -= n
                    except OSError:
                        pass
            self.used = used

    def _scan(self) -> tuple[list[tuple[float, int, Path]], int]:
        """(mtime, bytes, path) of every block file under root, and their total; stale temporary
        files of dead writers (older than a minute) are removed on the way."""
        files, used = [], 0
        try:
            subdirs = [d for d in os.scandir(self.root) if d.is_dir(follow_symlinks=False)]
        except OSError:
            return files, used
        for d in subdirs:
            try:
                entries = list(os.scandir(d.path))
            except OSError:
                continue
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if e.name.endswith(".tmp"):
                    if st.st_mtime < time.time() - 60:
                        Path(e.path).unlink(missing_ok=True)
                    continue
                if e.name.endswith(SUFFIX):
                    files.append((st.st_mtime, st.st_size, Path(e.path)))
                    used += st.st_size
        return files, used

    def describe(self) -> dict:
        """`/capability`'s view of this store."""
        out = {"enabled": self.enabled, "directory": str(self.dir), "budget_bytes": self.budget,
               "used_bytes": self.used, "hits": self.hits, "misses": self.misses,
               "blocks_written": self.written, "blocks_evicted": self.evicted,
               "blocks_refused": len(self.refused)}
        if self.reason:
            out["reason"] = self.reason
        if self.refused:
            out["last_refused"] = self.refused[-1].reason
        if self.write_failures:
            out.update(write_failures=self.write_failures, last_error=self.last_error)
        return out



def default_budget(share: float, meminfo: str | Path = "/proc/meminfo") -> int:
    """`share` of the host's MemAvailable, in bytes (0 when it cannot be read: no tier)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(int(line.split()[1]) * 1024 * share)
    except (OSError, ValueError, IndexError):
        pass
    return 0
