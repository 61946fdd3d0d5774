"""Loopback ports: a free one, or a clear error naming the one already in use."""

from __future__ import annotations

import random
import socket
import threading

#: Ports handed out by `free_port` start here (above the usual fixed service ports).
LOWEST = 15000
_rng = random.SystemRandom()  # processes picking at once do not follow one sequence
_handed: set[int] = set()
_lock = threading.Lock()


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1", *, below: int | None = None) -> int:
    """A port nothing is bound to now, for a listener that binds it later, and never one this
    process handed out before.

    Picked below the kernel's ephemeral range (or `below`, if lower): a port from that range
    (what binding port 0 returns) is also what the kernel gives every outgoing connection as
    its local port, so a connection opened between the pick and the listener's bind takes it
    and the bind fails. An SGLang server whose HTTP port went that way logged "address already
    in use" and hung in its shutdown instead of exiting. Falls back to port 0's answer when
    the range below is too small to pick from.
    """
    top = min(ephemeral_low(), below or 65536)
    if top - LOWEST >= 1000:
        for _ in range(200):
            port = _rng.randrange(LOWEST, top)
            with _lock:
                if port in _handed:
                    continue
            try:
                with socket.socket() as s:  # no SO_REUSEADDR: a port in any use fails here
                    s.bind((host, port))
            except OSError:
                continue
            with _lock:
                _handed.add(port)
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise OSError(
                f"port {host}:{port} is already in use: stop what holds it or pick another "
                "port (0 picks a free one)"
            ) from exc
