"""The daemon's settings as it resolved them, read from its HTTP admin API (`lmcache server
--http-port P`, `GET /config`): what the daemon says it runs with, never a guess from here.

lmcache 0.5.6 reports its worker counts there and over no ZMQ operation (nor in `/status`).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from .errors import DaemonUnavailable


@dataclass(frozen=True)
class DaemonSettings:
    """The part of the daemon's `MPServerConfig` this client relies on."""

    #: Threads of its CPU pool (LOOKUP, the prefetch status, free_lookup_locks,
    #: end_session, ping): `--max-cpu-workers`, else `--max-workers`.
    max_cpu_workers: int
    chunk_size: int


def read_settings(host: str, http_port: int, timeout_s: float) -> DaemonSettings:
    """`GET http://host:http_port/config`, its "mp" section. Raises DaemonUnavailable when
    it cannot be read or does not hold those settings."""
    url = f"http://{host}:{http_port}/config"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            mp = json.loads(resp.read())["mp"]
        return DaemonSettings(max_cpu_workers=int(mp["max_cpu_workers"]),
                              chunk_size=int(mp["chunk_size"]))
    except (OSError, urllib.error.URLError, ValueError, KeyError, TypeError) as exc:
        raise DaemonUnavailable(f"cannot read the daemon's settings at {url}: {exc}") from None
