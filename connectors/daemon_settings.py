"""The daemon's HTTP admin API (`lmcache server --http-port P`): its settings as it resolved
them (`GET /config`: what the daemon says it runs with, never a guess from here), and the
few other endpoints this product calls (`admin_call`: the L2 canary reads `/status` and drops
an L1 copy through `DELETE /cache/objects`).

lmcache 0.5.6 reports its worker counts, hash algorithm and L2 adapters there and over no ZMQ
operation (nor in `/status`, whose L2 adapters say `is_healthy` and nothing more).
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
    #: `--hash-algorithm`: with the chunk size and model name, what names a chunk's key.
    hash_algorithm: str = "blake3"
    #: `--l2-adapter`s as /config lists them (lmcache 0.5.6 leaves out their type).
    l2_adapters: tuple[dict, ...] = ()


def adapter_kind(adapter: dict) -> str:
    """resp, valkey, valkey cluster, fs or other: an `--l2-adapter` as `/config` lists it
    (lmcache 0.5.6 leaves out its type: told by the keys only each one has)."""
    if "startup_nodes" in adapter:
        return "valkey" + (" cluster" if adapter.get("cluster_mode") else "")
    if "host" in adapter and "port" in adapter:
        return "resp"
    return "fs" if "base_path" in adapter else "other"


def admin_call(host: str, http_port: int, path: str, timeout_s: float, *,
               method: str = "GET", body: object = None) -> dict:
    """One JSON call to the admin API. Raises DaemonUnavailable (naming the URL) when it
    does not answer in time or answers other than a JSON object."""
    url = f"http://{host}:{http_port}{path}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            out = json.loads(resp.read())
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise DaemonUnavailable(f"the daemon's admin API {method} {url}: {exc}") from None
    if not isinstance(out, dict):
        raise DaemonUnavailable(f"the daemon's admin API {method} {url}: not a JSON object")
    return out


def read_settings(host: str, http_port: int, timeout_s: float) -> DaemonSettings:
    """`GET http://host:http_port/config`. Raises DaemonUnavailable when it cannot be read
    or does not hold those settings."""
    try:
        cfg = admin_call(host, http_port, "/config", timeout_s)
    except DaemonUnavailable as exc:
        raise DaemonUnavailable(f"cannot read the daemon's settings: {exc}") from None
    try:
        mp = cfg["mp"]
        adapters = cfg.get("storage_manager", {}).get("l2_adapter_config", {}).get("adapters")
        return DaemonSettings(max_cpu_workers=int(mp["max_cpu_workers"]),
                              chunk_size=int(mp["chunk_size"]),
                              hash_algorithm=str(mp.get("hash_algorithm", "blake3")),
                              l2_adapters=tuple(adapters or ()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DaemonUnavailable(f"cannot read the daemon's settings at http://{host}:"
                                f"{http_port}/config: {exc!r} missing or malformed") from None
