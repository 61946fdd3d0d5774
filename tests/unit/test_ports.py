"""Loopback ports handed to listeners that bind later, and a server whose port was taken.

An SGLang server in a fresh-clone CI run never became ready: its HTTP port, picked by binding
port 0, came from the kernel's ephemeral range, which is also where every outgoing
connection's local port comes from. A connection opened before uvicorn bound the port took it;
uvicorn logged "address already in use" and SGLang hung in its shutdown for the whole 180 s.
"""

from __future__ import annotations

import os
import socket
import stat
import time

import pytest

from lmcache_loadback.connectors.ports import LOWEST, ephemeral_low, free_port
from lmcache_loadback.harness.sglang.server import BIND_FAILED, PortTaken, SGLangServer


def test_free_ports_are_below_the_ephemeral_range_and_never_repeat():
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(LOWEST <= p < ephemeral_low() for p in ports), sorted(ports)[-5:]


def test_a_port_held_by_a_connection_is_not_handed_out():
    # a connection's local port in the picking range: free_port must see it is in use
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen()
    held = []
    try:
        for _ in range(40):
            c = socket.socket()
            c.bind(("127.0.0.1", free_port()))
            c.connect(lst.getsockname())
            held.append(c)
        taken = {c.getsockname()[1] for c in held}
        assert not taken & {free_port() for _ in range(300)}
    finally:
        for c in held:
            c.close()
        lst.close()


def test_below_bounds_the_pick():
    top = ephemeral_low() - 10000
    assert all(LOWEST <= free_port(below=top) < top for _ in range(100))


def _fake_server(tmp_path, *, bind_fails: bool) -> str:
    """A stand-in for `python -m sglang.launch_server`: the real one cannot be made to lose its
    port on demand. It logs uvicorn's bind failure (or nothing) and then hangs, as SGLang
    does."""
    script = tmp_path / "fake-python"
    line = f'echo "ERROR:    [Errno 98] {BIND_FAILED} (\'127.0.0.1\', 1): address already in use"'
    script.write_text("#!/bin/sh\n" + (line if bind_fails else "") + "\nexec sleep 60\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_a_taken_port_is_told_at_once_and_an_own_port_is_picked_anew(tmp_path, capsys):
    server = SGLangServer(python=_fake_server(tmp_path, bind_fails=True),
                          log_path=tmp_path / "server.log")
    first = server.port
    t0 = time.monotonic()
    with pytest.raises(PortTaken, match="address already in use"):
        server.start(timeout_s=60)
    assert time.monotonic() - t0 < 20  # not the 60 s start limit
    assert server.port != first  # the second launch ran on a new port
    assert "starting again on another port" in capsys.readouterr().err
    assert server.proc is None  # both launches stopped (stop() forgets a process it ended)


def test_a_port_given_by_the_caller_is_not_changed(tmp_path):
    port = free_port()
    server = SGLangServer(python=_fake_server(tmp_path, bind_fails=True), port=port,
                          log_path=tmp_path / "server.log")
    with pytest.raises(PortTaken):
        server.start(timeout_s=60)
    assert server.port == port


def test_a_hang_without_the_bind_line_still_waits_for_the_limit(tmp_path):
    server = SGLangServer(python=_fake_server(tmp_path, bind_fails=False),
                          log_path=tmp_path / "server.log")
    t0 = time.monotonic()
    with pytest.raises(Exception, match="not ready within 2 s") as info:
        server.start(timeout_s=2)
    assert not isinstance(info.value, PortTaken)
    assert time.monotonic() - t0 >= 2
    assert os.path.exists(tmp_path / "server.log")
