"""`hetserve serve`: inventory -> select devices -> one worker per device -> public HTTP API.

The listening socket is bound here, before any worker starts, so a port already in use is a
one-line usage error instead of a half-started server. Workers start in the app's
`lifespan`; a line `hetserve ready at http://HOST:PORT ...` is logged once every worker is
ready (or has failed with its reason). If every worker failed to start there is nothing to
serve: the server stops and `run` returns 1. SIGTERM/SIGINT: uvicorn stops accepting, gives
in-flight requests `drain_timeout_s`, then the supervisor stops the workers; a second
Ctrl-C skips the wait.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

from server.config.settings import RouterSettings
from server.errors import UsageError

logger = logging.getLogger("hetserve")


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per worker call would drown the log; the router logs what matters itself.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on connections whose socket says
    # so, and without it every response waits ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"Cannot listen on `{host}:{port}`: {e.strerror or e}. Pick another --port or --host") from e
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _log_api_key(settings: RouterSettings) -> None:
    if settings.api_key is not None:
        logger.info("API key required on every route but /health (key from %s)", settings.api_key_source)
    elif not _is_loopback(settings.host):
        logger.warning("listening on %s without an API key: anyone who reaches this address can generate. "
                       "Set --api-key-file PATH or $HETSERVE_API_KEY", settings.host)


_ANY_ADDRESS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}  # bound to all: a URL one can open here


def _url(host: str, port: int) -> str:
    """The URL the ready line prints: one a browser on this host opens (a wildcard bind shows
    the loopback address: `http://0.0.0.0:8000` opens nothing in most browsers)."""
    host = _ANY_ADDRESS.get(host, host)
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def run(args) -> int:
    import uvicorn

    from server.commands.inventory import inventory
    from server.edge.app import create_app, ready_summary
    from server.edge.http11 import EdgeLimits, edge_protocol
    from workers.contract import select_devices
    from workers.contract.tracing import TracingUnavailable, start_tracing

    settings = RouterSettings.from_args(args)
    _setup_logging(settings.log_level)
    try:  # before anything starts: a missing exporter is a usage error
        tracing = start_tracing(settings.otlp_endpoint, "hetserve-router")
    except (TracingUnavailable, ValueError) as e:
        raise UsageError(str(e)) from e
    _log_api_key(settings)
    # 1. devices: NVML or the simulated topology (never CUDA), then --devices
    devices = select_devices(inventory(getattr(args, "simulate", None)), getattr(args, "devices", "all"))
    if not devices:
        logger.info("no GPU found and no --simulate: serving with one CPU worker")
    # 2. the listening socket, before anything starts
    sock = _bind(settings.host, settings.port)
    url = _url(settings.host, sock.getsockname()[1])
    outcome = {"code": 0}

    def on_settled(supervisor) -> None:
        if supervisor.all_failed():
            # each worker's reason was logged once as it failed (server/fleet/supervisor.py)
            logger.error("no worker could start (%d failed, each reason above); stopping", len(supervisor.workers))
            outcome["code"] = 1
            server.should_exit = True
            return
        ready = len(supervisor.ready())
        logger.info("hetserve ready at %s (%d/%d workers ready: %s; model %s)", url, ready,
                    len(supervisor.workers), ready_summary(supervisor), settings.model_dir)

    # 3. the app; its lifespan starts the workers
    app = create_app(settings, devices, on_settled=on_settled, tracing=tracing)
    config = uvicorn.Config(
        app,
        log_level=settings.log_level,
        access_log=settings.log_level == "debug",
        timeout_graceful_shutdown=max(1, int(settings.drain_timeout_s)),
        timeout_keep_alive=30,
        server_header=False,
        lifespan="on",
        http=edge_protocol(EdgeLimits.from_settings(settings, app.state.ctx.metrics.client_write_timeout)),
    )
    server = uvicorn.Server(config)
    logger.info("hetserve starting %d worker(s) for %s; listening on %s", max(1, len(devices)),
                settings.model_dir, url)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if not server.started:
        return 1
    return outcome["code"]
