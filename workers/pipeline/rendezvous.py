"""Where a pipeline's stages meet: a file in the run directory, and sockets on the plan's host only.

Design: at each start the first stage makes a fresh rendezvous (`Rendezvous.fresh`): a
`torch.distributed` file store named with a random token, beside the plan in the router's run
directory (mode 0700; the store file itself 0600), and a record of it, `<plan>.rendezvous.json`
(0600), written before the other stages start and read by them (`Rendezvous.read`). Nothing
listens for the rendezvous, so no one who can only reach a port can read or write its keys; only
this user's processes can open the file. The backend's own sockets (gloo's pairs, NCCL's
bootstrap) are bound to the interface that holds the plan's host (`bind_interface`:
`GLOO_SOCKET_IFNAME`, `NCCL_SOCKET_IFNAME`), loopback for every plan the router writes, at ports
the kernel picks afresh at each start. What the stages then send each other is typed
(workers/pipeline/wire.py). Trade-off: a file store needs every stage on one filesystem, which a
pipeline's stages, workers of one host, always share.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


class RendezvousError(RuntimeError):
    """A pipeline's stages cannot meet: which file or address is at fault."""


def record_path(plan_path: str | Path) -> Path:
    plan_path = Path(plan_path)
    return plan_path.with_name(f"{plan_path.stem}.rendezvous.json")


@dataclass(frozen=True)
class Rendezvous:
    """One start's meeting place: the store file every stage opens."""

    store: str

    @classmethod
    def fresh(cls, plan_path: str | Path) -> Rendezvous:
        """A new store file for this start (an earlier start's removed) and its record beside the plan."""
        plan_path = Path(plan_path)
        for stale in plan_path.parent.glob(f"{plan_path.stem}.*.store"):
            stale.unlink(missing_ok=True)
        store = plan_path.with_name(f"{plan_path.stem}.{secrets.token_hex(16)}.store")
        os.close(os.open(store, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        record = record_path(plan_path)
        tmp = record.with_name(f"{record.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"store": str(store)}, f)
        os.replace(tmp, record)
        return cls(str(store))

    @classmethod
    def read(cls, plan_path: str | Path) -> Rendezvous:
        """The record the first stage wrote for this start."""
        path = record_path(plan_path)
        try:
            store = json.loads(path.read_text())["store"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise RendezvousError(f"Pipeline rendezvous `{path}` cannot be read (the first stage writes it before "
                                  f"starting the others): {e}") from e
        if not isinstance(store, str) or Path(store).parent != path.parent:
            raise RendezvousError(f"Pipeline rendezvous `{path}` names store `{store}`. Accepted: a file beside it")
        return cls(store)

    def open(self, world_size: int):
        """The store every stage of this start opens (torch.distributed's file store)."""
        import torch.distributed as dist

        return dist.FileStore(self.store, world_size)

    def remove(self) -> None:
        Path(self.store).unlink(missing_ok=True)


def interface_of(host: str) -> str:
    """The name of this host's network interface that holds the address `host` (Linux)."""
    try:
        address = socket.gethostbyname(host)
    except OSError as e:
        raise RendezvousError(f"Pipeline host `{host}` is no address of this host: {e}") from e
    names = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            names.append(f"{name} {socket.inet_ntoa(packed[20:24])}")
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    raise RendezvousError(f"No network interface of this host holds the pipeline's host `{host}`. Accepted: "
                          f"{', '.join(names) or 'none found'}")


def bind_interface(host: str, backend: str) -> str:
    """Bind the backend's sockets to the interface of `host` (unless the environment already names
    one: then that one was asked for); the interface used."""
    var = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    if os.environ.get(var):
        logger.info("pipeline sockets on %s=%s, as the environment says", var, os.environ[var])
        return os.environ[var]
    name = interface_of(host)
    os.environ[var] = name  # read by the backend when the process group is made, in this process only
    return name
