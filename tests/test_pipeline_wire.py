"""The pipeline's wire and rendezvous: typed messages only, sockets on loopback, a fresh meeting per start.

Units first: the step layout (workers/pipeline/wire.py) round-trips every `SeqChunk` field and
refuses bytes in any other layout. Then real processes: a rogue first stage that sends a pickle in
place of the step's chunks to a real `StageLink` is refused and nothing is unpickled; and a real
`hetserve serve --pipeline 3` whose stages listen on 127.0.0.1 only, meet through a store file in
the run directory (no listening store), and after `kill -9` of a stage come back on other ports
through another store file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.router_harness import ROOT, RouterProcess, alive
from workers.kv.batch import SeqChunk
from workers.pipeline.rendezvous import Rendezvous, RendezvousError, interface_of, record_path
from workers.pipeline.wire import MAGIC, STEP, WireError, decode_items, encode_items, read_header

ITEMS = [(SeqChunk(0, 3, [4, 5], 1, 17, 3, [[7], [8, 9]], 2), [11, 12, 13]),
         (SeqChunk(8, 1, [1], 1, None, 0, [], -1), [99])]


def test_the_step_layout_round_trips_every_field():
    assert decode_items(encode_items(ITEMS)) == ITEMS


@pytest.mark.parametrize("values, needle", [
    (encode_items(ITEMS)[:-1], "ends inside token ids"),
    (encode_items(ITEMS) + [0], "1 values after its 2 chunks"),
    ([1, 0, 1, 0, 0, 0, 0, -2, 0, 0, 5], "`state_slot` the value `-2`"),
    ([1, 0, 2, 3, 0, 0, 0, -1, 0, 0, 5, 6], "`num_logits` the value `3`"),
    ([0], "`count` the value `0`"),
])
def test_a_malformed_step_is_refused_naming_what_is_wrong(values, needle):
    with pytest.raises(WireError, match=needle):
        decode_items(values)


def test_a_header_without_the_magic_is_refused():
    """Guards `read_header`'s magic check: the old layout's `[kind, n, rows]` is not a header."""
    with pytest.raises(WireError, match="not a message of this pipeline"):
        read_header([STEP, 10, 2, 0])
    assert read_header([MAGIC, STEP, 10, 2]) == (STEP, 10, 2)


def test_a_fresh_rendezvous_each_start_private_and_beside_the_plan(tmp_path):
    plan = tmp_path / "gpu0.pipeline.json"
    first, second = Rendezvous.fresh(plan), Rendezvous.fresh(plan)
    assert first.store != second.store and not Path(first.store).exists()  # the earlier start's store is gone
    assert Rendezvous.read(plan) == second
    assert os.stat(second.store).st_mode & 0o777 == 0o600 and os.stat(record_path(plan)).st_mode & 0o777 == 0o600
    record_path(plan).write_text(json.dumps({"store": "/elsewhere/x.store"}))
    with pytest.raises(RendezvousError, match="Accepted: a file beside it"):
        Rendezvous.read(plan)


def test_loopback_has_an_interface_and_a_foreign_address_is_named():
    assert interface_of("127.0.0.1")
    with pytest.raises(RendezvousError, match="`192.0.2.1`"):
        interface_of("192.0.2.1")


# ---- real processes -------------------------------------------------------------------------------
_STAGE = r"""
import sys, torch, pickle
from workers.contract.pipeline import PipelinePlan, StagePlan
from workers.contract import WorkerConfig
from workers.pipeline.rendezvous import Rendezvous
from workers.pipeline.transport import StageLink
from workers.pipeline import wire
rank, plan_path, marker = int(sys.argv[1]), sys.argv[2], sys.argv[3]
plan = PipelinePlan("127.0.0.1", (StagePlan(0, 1), StagePlan(1, 2, WorkerConfig(socket="/s"))), 30.0)
link = StageLink.join(plan, rank, torch.device("cpu"), torch.float32, Rendezvous.read(plan_path))

class Payload:  # what an unpickler would run
    def __reduce__(self):
        return (open, (marker, "w"))

if rank == 0:  # a rogue first stage: a pickle where the step's chunks go
    data = pickle.dumps([Payload()])
    data += bytes(-len(data) % 8)
    meta = torch.frombuffer(bytearray(data), dtype=torch.int64)
    torch.distributed.send(torch.tensor(wire.header(wire.STEP, meta.numel(), 1)), 1)
    torch.distributed.send(meta, 1)
    torch.distributed.send(torch.zeros(1, 4), 1)
else:
    try:
        link.recv_step(4)
        print("accepted")
    except wire.WireError as e:
        print("refused:", e)
"""


def test_a_pickle_sent_in_place_of_a_step_is_refused_never_unpickled(tmp_path):
    """Guards `StageLink.recv_step`'s `decode_items` (workers/pipeline/transport.py): a stage that
    unpickled what it received would open the marker file; this one refuses the message."""
    plan_path, marker = tmp_path / "p.json", tmp_path / "unpickled"
    Rendezvous.fresh(plan_path)
    procs = [subprocess.Popen([sys.executable, "-c", _STAGE, str(rank), str(plan_path), str(marker)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (1, 0)]
    out = [p.communicate(timeout=120)[0] for p in procs]
    assert "refused: A pipeline step message" in out[0], out
    assert not marker.exists()


def _listening(pid: int) -> set[tuple[str, int]]:
    """(local address, port) of each TCP socket `pid` listens on (Linux /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                address, port = cols[1].split(":")
                raw = bytes.fromhex(address)
                shown = ".".join(str(b) for b in raw[::-1]) if width == 8 else raw.hex()
                out.add((shown, int(port, 16)))
    return out


def _stages(router) -> list[int]:
    (worker,) = router.workers()
    assert worker["state"] == "ready", worker
    return [s["pid"] for s in worker["pipeline"]["stages"]]


@pytest.mark.slow
def test_stages_listen_on_loopback_only_and_meet_afresh_after_a_restart():
    """Guards `bind_interface` and `Rendezvous.fresh` (workers/pipeline/rendezvous.py): before
    them the first stage's store listened on every interface at the plan's one port, restart
    after restart."""
    router = RouterProcess(["--simulate", "sm_80:10MiB,sm_86:10MiB,sm_90:10MiB", "--pipeline", "3"],
                           env={"HETSERVE_COMPILE": "off"}, fake=False, ready_timeout=300)
    try:
        pids = _stages(router)
        before = {pid: _listening(pid) for pid in pids}
        assert all(before.values()), before  # gloo's pairs listen
        assert {host for socks in before.values() for host, _ in socks} == {"127.0.0.1"}, before
        (record,) = Path(tempfile.gettempdir()).glob(f"hetserve-{router.proc.pid}-*/*.rendezvous.json")
        store = json.loads(record.read_text())["store"]
        os.kill(pids[1], signal.SIGKILL)
        back = router.wait_for(lambda: (w := router.workers()[0])["state"] == "ready" and w["restarts"] >= 1, 240)
        assert back
        after_pids = _stages(router)
        after = {pid: _listening(pid) for pid in after_pids}
        assert {host for socks in after.values() for host, _ in socks} == {"127.0.0.1"}, after
        old_ports = {port for socks in before.values() for _, port in socks}
        assert not old_ports & {port for socks in after.values() for _, port in socks}
        assert json.loads(record.read_text())["store"] != store and not Path(store).exists()
        with router.client(timeout=120) as c:
            assert c.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 3}}).status_code == 200
    finally:
        router.stop()
    assert not any(alive(p) for p in pids)
