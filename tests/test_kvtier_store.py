"""The host KV tier's block files (workers/kvtier/store.py): keyed, checksummed, budgeted, degradable."""

from __future__ import annotations

import os
import time

import pytest

from workers.kvtier.store import HEADER_BYTES, TierStore, default_budget

KEY_A, KEY_B = b"a" * 32, b"b" * 32


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_a_block_written_is_read_back_and_counted(tmp_path):
    store = TierStore(tmp_path, 1 << 20, KEY_A)
    assert store.enabled and store.reason is None
    assert store.put(h(1), b"payload-1")
    assert not store.put(h(1), b"payload-1"), "a block already stored is not written again"
    assert store.get(h(1)) == b"payload-1"
    assert store.get(h(2)) is None
    d = store.describe()
    assert (d["hits"], d["misses"], d["blocks_written"]) == (1, 1, 1)
    assert d["used_bytes"] > len(b"payload-1")
    assert not list(store.dir.glob("*.tmp")), "the temporary name was renamed away"


def test_a_corrupted_block_is_refused_and_deleted(tmp_path):
    """Guards the checksum check in `TierStore._read`: a flipped payload byte must not be served."""
    store = TierStore(tmp_path, 1 << 20, KEY_A)
    store.put(h(1), b"0123456789")
    path = store.path(h(1))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert store.get(h(1)) is None
    assert not path.exists()
    assert "checksum" in store.describe()["last_refused"]


def test_a_truncated_block_is_refused(tmp_path):
    store = TierStore(tmp_path, 1 << 20, KEY_A)
    store.put(h(1), b"0123456789")
    path = store.path(h(1))
    path.write_bytes(path.read_bytes()[:-3])
    assert store.get(h(1)) is None and not path.exists()


def test_a_foreign_formats_block_is_refused_even_under_the_right_name(tmp_path):
    """Guards the format key check: a block of another KV format copied into this format's place."""
    a, b = TierStore(tmp_path, 1 << 20, KEY_A), TierStore(tmp_path, 1 << 20, KEY_B)
    b.put(h(1), b"other format")
    assert a.get(h(1)) is None, "another format's directory is invisible"
    os.replace(b.path(h(1)), a.path(h(1)))
    assert a.get(h(1)) is None
    assert "another KV format" in a.describe()["last_refused"]
    assert not a.path(h(1)).exists()


def test_a_block_under_another_chains_name_is_refused(tmp_path):
    store = TierStore(tmp_path, 1 << 20, KEY_A)
    store.put(h(1), b"one")
    os.replace(store.path(h(1)), store.path(h(2)))
    assert store.get(h(2)) is None
    assert "another chain" in store.describe()["last_refused"]


def test_the_budget_evicts_the_least_recently_used_blocks_across_stores(tmp_path):
    """Two stores (two workers) share one budget; a block read recently outlives older ones."""
    payload = b"x" * 1000
    size = len(payload) + HEADER_BYTES
    a = TierStore(tmp_path, 4 * size, KEY_A)
    for i in range(3):
        assert a.put(h(i), payload)
    b = TierStore(tmp_path, 4 * size, KEY_B)  # a worker starting later counts what is there
    old = time.time() - 100
    for i in range(3):
        os.utime(a.path(h(i)), (old + i, old + i))
    assert a.get(h(0)) == payload  # now the most recent
    assert b.put(h(10), payload)  # 4 blocks: at the budget
    assert b.put(h(11), payload)  # past it: evicts down to 90% of it
    assert not a.path(h(1)).exists() and not a.path(h(2)).exists(), "the two least recently used went"
    assert a.path(h(0)).exists() and b.path(h(10)).exists() and b.path(h(11)).exists()
    assert b.describe()["blocks_evicted"] == 2
    assert b.used <= 4 * size


def test_a_block_larger_than_the_budget_is_not_stored(tmp_path):
    store = TierStore(tmp_path, 100, KEY_A)
    assert not store.put(h(1), b"x" * 200)
    assert store.get(h(1)) is None


def test_an_unwritable_directory_degrades_to_no_tier_with_the_reason(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    store = TierStore(blocked / "tier", 1 << 20, KEY_A)
    assert not store.enabled
    assert "cannot be written" in store.reason and str(blocked) in store.reason
    assert not store.put(h(1), b"x") and store.get(h(1)) is None
    assert store.describe()["reason"] == store.reason


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through a read-only mode")
def test_a_read_only_directory_degrades(tmp_path):
    tmp_path.chmod(0o500)
    try:
        store = TierStore(tmp_path / "tier", 1 << 20, KEY_A)
        assert not store.enabled and "cannot be written" in store.reason
    finally:
        tmp_path.chmod(0o700)


def test_a_zero_budget_is_off_with_the_flag_named(tmp_path):
    store = TierStore(tmp_path, 0, KEY_A)
    assert not store.enabled and "`--kv-host-bytes 0`" in store.reason
    assert not (tmp_path / KEY_A.hex()[:32]).exists()


def test_the_default_budget_is_a_share_of_mem_available(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 2000 kB\nMemAvailable:    1000 kB\n")
    assert default_budget(0.1, meminfo) == 102400
    assert default_budget(0.1, tmp_path / "absent") == 0


def test_a_failing_write_is_counted_and_shown_and_nothing_half_written_stays(tmp_path, monkeypatch):
    """A full /dev/shm (ENOSPC) loses the block, not the worker: the reason is on `/capability`."""
    import builtins
    import errno

    store = TierStore(tmp_path, 1 << 20, KEY_A)
    real_open = builtins.open

    def full(path, mode="r", *a, **k):
        if "w" in mode and str(path).endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", full)
    assert not store.put(h(1), b"x")
    monkeypatch.undo()
    d = store.describe()
    assert d["write_failures"] == 1 and "No space left" in d["last_error"]
    assert not list(store.dir.iterdir()) and store.get(h(1)) is None


KILLED_WRITER = """
import sys
from workers.kvtier.store import TierStore
store = TierStore(sys.argv[1], 1 << 34, b"a" * 32)
for i in range(10_000):
    store.put(i.to_bytes(32, "big"), bytes([i % 251]) * (8 << 20))
"""


def _writing(store_dir) -> bool:
    """A temporary file past its header exists (a block is being written)."""
    for p in store_dir.glob(".*.tmp"):
        try:
            if p.stat().st_size > HEADER_BYTES:
                return True
        except FileNotFoundError:  # renamed meanwhile
            pass
    return False


def test_a_writer_killed_with_9_leaves_whole_blocks_or_none(tmp_path):
    """Guards the temporary name and the rename in `TierStore.put` and the stale sweep in
    `TierStore._scan`: a process killed with -9 while it writes blocks of 8 MiB leaves every block
    file whole (each reads back, checksum and all, with the payload it was given), and what it was
    writing only under a temporary name that no read takes; that torn write moved under a block's
    name is refused, never read; a later store sweeps the temporary file once it is stale."""
    import signal
    import subprocess
    import sys

    from tests.router_harness import ROOT

    child = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], cwd=ROOT)
    store_dir = tmp_path / KEY_A.hex()[:32]
    deadline = time.monotonic() + 60
    try:
        while len(list(store_dir.glob("*.kvb"))) < 3:
            assert child.poll() is None and time.monotonic() < deadline, "the writer never wrote three blocks"
            time.sleep(0.005)
        while not _writing(store_dir) and time.monotonic() < deadline:  # kill it while a write is under way
            pass
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    store = TierStore(tmp_path, 1 << 34, KEY_A)
    blocks = sorted(store.dir.glob("*.kvb"))
    assert len(blocks) >= 3
    for path in blocks:
        i = int(path.stem, 16)
        assert store.get(h(i)) == bytes([i % 251]) * (8 << 20), f"block {i} is not whole"
    leftovers = list(store.dir.glob(".*.tmp"))
    assert len(leftovers) <= 1, leftovers
    for torn in leftovers:  # (none when the kill fell between two writes: rare, and nothing is torn then)
        i = int(torn.name[1:].split(".")[0], 16)
        assert not store.contains(h(i)) and store.get(h(i)) is None, "a temporary file is never read"
        os.replace(torn, store.path(h(i)))  # as if a write had been torn under the block's own name
        assert store.get(h(i)) is None and not store.path(h(i)).exists()
        assert "bytes" in store.describe()["last_refused"]
    stale = store.dir / f".{h(99_999).hex()}.kvb.1.1.tmp"
    stale.write_bytes(b"x" * 100)
    os.utime(stale, (time.time() - 120, time.time() - 120))
    TierStore(tmp_path, 1 << 34, KEY_A)  # opening scans the root
    assert not stale.exists(), "a dead writer's temporary file is swept once stale"
