"""LMCache's own config keys, as SGLang's `--lmcache-config-file` passes them, and what each
becomes here (`translate`), so an upstream LMCache MP YAML loads unchanged. Keys and defaults
are lmcache 0.5.6's (`lmcache/v1/config.py` _CONFIG_DEFINITIONS and aliases, and the
`lmcache.mp.*` keys its integrations read), checked against the installed package by a test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

# Every top-level key (and alias) of lmcache 0.5.6's engine config.
ENGINE_KEYS = frozenset("""
app_id audit_actual_remote_url blend_check_layers blend_min_tokens blend_recompute_ratios
blend_special_str blend_thresholds blocking_timeout_secs cache_policy chunk_size
chunk_statistics_auto_exit_target_unique_chunks chunk_statistics_auto_exit_timeout_hours
chunk_statistics_auto_start_statistics chunk_statistics_strategy controller_pull_url
controller_reply_url controller_url enable_async_loading enable_blending
enable_chunk_statistics enable_controller enable_hidden_state_cache enable_kv_events
enable_lazy_memory_allocator enable_p2p enable_pd enable_scheduler_bypass_lookup enable_xpyd
external_backends external_lookup_client extra_config gds_backend gds_buffer_size gds_path
gds_path_sharding hidden_state_layers hidden_states_retrieve_mode hit_miss_ratio
internal_api_server_enabled internal_api_server_host internal_api_server_include_index_list
internal_api_server_port_start internal_api_server_socket_path_prefix
lazy_memory_expand_trigger_ratio lazy_memory_initial_ratio lazy_memory_safe_size
lazy_memory_step_ratio lmcache_instance_id lmcache_worker_heartbeat_delay_time
lmcache_worker_heartbeat_time lmcache_worker_ids lmcache_worker_port lmcache_worker_ports
local_cpu local_cpu_use_hugepages local_disk local_disk_path_sharding
lookup_server_worker_ids lookup_timeout_ms maru_path maru_pool_size
max_hidden_state_cpu_size max_local_cpu_size max_local_disk_size min_retrieve_tokens mp_host
mp_port nixl_backends nixl_buffer_device nixl_buffer_size nixl_peer_alloc_port
nixl_peer_host nixl_peer_init_port nixl_proxy_host nixl_proxy_port nixl_role numa_mode
p2p_host p2p_init_ports p2p_lookup_ports pd_allocation_timeout_sec pd_backend_mode
pd_bidirectional pd_buffer_device pd_buffer_size pd_condition_poll_interval_sec
pd_max_prefill_len pd_peer_alloc_port pd_peer_host pd_peer_init_port pd_peer_query_port
pd_proxy_host pd_proxy_port pd_role pd_shutdown_timeout_sec pd_skip_proxy_notification
pin_check_interval_sec pin_timeout_sec plugin_locations pre_caching_hash_algorithm
priority_limit py_enable_gc remote_config_url remote_serde remote_storage_plugins remote_url
reserve_local_cpu_size retrieve_locations run_script_api_enabled runtime_plugin_locations
save_decode_cache save_unfull_chunk script_allowed_imports storage_plugins store_location
transfer_channel use_gds use_gpu_connector_v3 use_layerwise
""".split())

# Engine keys that are this product's keys too, with the same meaning.
SHARED_KEYS = frozenset({"chunk_size", "mp_host", "mp_port", "extra_config"})

# Engine keys that look like ours but are not read here: the one to set instead.
_CLOSEST = {
    "lookup_timeout_ms": "deadlines.lookup_ms (LMCache's is its in-process lookup client's)",
    "min_retrieve_tokens": "break_even.min_tokens (LMCache's is read by its in-process engine)",
    "blocking_timeout_secs": "deadlines.retrieve_max_ms (LMCache's bounds remote-backend reads)",
    "max_local_cpu_size": "the daemon's --l1-size-gb (the cache lives in the daemon)",
    "local_cpu": "the daemon's --l1-size-gb (the cache lives in the daemon)",
}
_ENGINE_ONLY = ("configures LMCache's in-process engine, which in MP mode lives in the daemon "
                "and takes its settings from the daemon's command line; not read here")

UPSTREAM_MQ_TIMEOUT_S = 300.0        # SGLang's connector: every blocking call waits this long
UPSTREAM_HEARTBEAT_S = 10.0

_TRANSFER_MODES = ("auto", "engine_driven", "lmcache_driven")


class UpstreamKeyError(ValueError):
    """An upstream key with a value that cannot be used; `key` is its path in the file."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Row:
    """One upstream key of a file: what it set here (`target`, None if ignored) and why."""

    key: str
    value: Any
    target: str | None
    note: str


def _seconds(key: str, value: Any) -> float:
    """Upstream does float(value): a number or a numeric string, here also finite and > 0."""
    try:
        s = float(value) if not isinstance(value, bool) and isinstance(value, (int, float, str)) \
            else math.nan
    except ValueError:
        s = math.nan
    if not (math.isfinite(s) and s > 0):
        raise UpstreamKeyError(key, f"must be a finite number of seconds > 0, got {_show(value)}; "
                                    "upstream reads it as seconds (e.g. 10)")
    return s


def _mq_timeout(key: str, value: Any, data: dict) -> Row:
    s = _seconds(key, value)
    return _set(data, key, value, ("deadlines", "retrieve_max_ms"), s * 1000, (
        f"upstream waits up to {s:g} s on every blocking call (lookup, retrieve, store, "
        f"register; default {UPSTREAM_MQ_TIMEOUT_S:g} s, which is how a dead daemon stalls the "
        "scheduler); here it only caps the retrieve deadline, which otherwise scales with the "
        "prefix (deadlines.retrieve_base_ms + retrieve_per_ki_token_ms per 1024 tokens); "
        "lookup and control calls keep their own millisecond deadlines"))


def _heartbeat(key: str, value: Any, data: dict) -> Row:
    s = _seconds(key, value)
    return _set(data, key, value, ("heartbeat", "interval_ms"), s * 1000, (
        f"ping period (upstream default {UPSTREAM_HEARTBEAT_S:g} s); here a failed ping also "
        "marks the daemon down and a restart re-registers"))


def _transfer_mode(key: str, value: Any, data: dict) -> Row:
    if value not in _TRANSFER_MODES:
        raise UpstreamKeyError(key, f"must be one of {', '.join(_TRANSFER_MODES)}, got "
                                    f"{_show(value)}; or remove it")
    note = ("this product always copies the daemon's bytes into the engine's KV itself "
            "(engine_driven); `transfer` picks pickle or shm for the bytes")
    if value == "lmcache_driven":
        note = "not supported here (the daemon writing the engine's KV through CUDA IPC); " + note
    return Row(key, value, None, "ignored: " + note)


def _vllm_only(instead: str = "") -> Callable[[str, Any, dict], Row]:
    def row(key: str, value: Any, data: dict) -> Row:
        why = "ignored: read by LMCache's vLLM connector only, not by SGLang's nor this product"
        return Row(key, value, None, why + (f"; set {instead}" if instead else ""))
    return row


def _address(instead: str) -> Callable[[str, Any, dict], Row]:
    """lmcache.mp.host / port: a vLLM connector's key, read from vLLM's config, not this file."""
    def row(key: str, value: Any, data: dict) -> Row:
        return Row(key, value, None, (
            "ignored in this file: a vLLM connector reads it from vLLM's "
            "kv_connector_extra_config (LMCache's LMCacheMPConnector, and LoadBackConnector, "
            f"where it overrides {instead}); in this file set {instead}"))
    return row


# The `lmcache.mp.*` keys lmcache 0.5.6 reads (under extra_config), and what each does here.
MP_KEYS: dict[str, Callable[[str, Any, dict], Row]] = {
    "lmcache.mp.mq_timeout": _mq_timeout,
    "lmcache.mp.heartbeat_interval": _heartbeat,
    "lmcache.mp.mp_transfer_mode": _transfer_mode,
    "lmcache.mp.host": _address("mp_host"),
    "lmcache.mp.port": _address("mp_port"),
    "lmcache.mp.server_urls": _vllm_only("mp_host and mp_port"),
    "lmcache.mp.autostart": _vllm_only(),
    "lmcache.mp.eager_prefetch": _vllm_only(),
    "lmcache.mp.isolated_ipc": _vllm_only(),
    "lmcache.mp.lazy_offload": _vllm_only(),
    "lmcache.mp.lazy_offload_policy": _vllm_only(),
    "lmcache.mp.lazy_offload_select_count": _vllm_only(),
    "lmcache.mp.lazy_offload_threshold": _vllm_only(),
    "lmcache.mp.nonblocking_lookup_status": _vllm_only(),
    "lmcache.mp.save_decode_cache": _vllm_only(),
    "lmcache.mp.transfer_intermediate_tensors": _vllm_only(),
    "lmcache.mp.use_vmm_api": _vllm_only(),
    "lmcache.mp.hash_algorithm": _vllm_only(),
    "lmcache.mp.lazy_offload_horizon_steps": _vllm_only(),
    "lmcache.mp.lazy_offload_max_drain_per_step": _vllm_only(),
    "lmcache.mp.lazy_offload_max_deferral_seconds": _vllm_only(),
}


def _set(data: dict, key: str, value: Any, target: tuple[str, str], mapped: float,
         why: str) -> Row:
    section, field = target
    path = f"{section}.{field}"
    sec = data.get(section)
    if isinstance(sec, dict) and field in sec:  # the product's own key, when both are given
        return Row(key, value, None, f"ignored: {path} is set in the file and wins; {why}")
    if sec is not None and not isinstance(sec, dict):
        return Row(key, value, None, f"ignored: {section} is not a mapping")
    data[section] = {**(sec or {}), field: mapped}
    return Row(key, value, path, f"-> {path} = {mapped:g}; {why}")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def translate(data: dict) -> tuple[dict, list[Row], dict[str, str]]:
    """Map upstream keys onto ours; called by `LoadBackConfig.from_dict` once per file, before
    validation (`mp_host`, `mp_port`, `extra_config: {lmcache.mp.*}`, engine keys such as
    `chunk_size`). `loadback config validate` prints the rows, so an operator sees which
    upstream keys took effect, onto which key, and why the others did not. Never guesses: a
    key lmcache 0.5.6 does not read is refused like any unknown key, and so is a value
    upstream could not parse either, naming the key.

    Returns the data with LMCache engine keys removed and `lmcache.mp.*` values applied to our
    keys (ours win when both are given), one Row per upstream key, and {our key path: the
    upstream key that set it}. Raises UpstreamKeyError for an unknown `lmcache.mp.*` key or a
    value it cannot use. Never mutates its argument.
    """
    data = dict(data)
    rows: list[Row] = []
    for key in [k for k in data if isinstance(k, str) and k in ENGINE_KEYS - SHARED_KEYS]:
        value = data.pop(key)
        closest = _CLOSEST.get(key)
        why = f"not read here; the setting that decides this is {closest}" if closest \
            else _ENGINE_ONLY
        rows.append(Row(key, value, None, f"ignored: {why}"))
    host = data.get("mp_host")
    if isinstance(host, str) and host.startswith("tcp://"):  # SGLang's connector accepts both
        data["mp_host"] = host[len("tcp://"):].rstrip(":")
        rows.append(Row("mp_host", host, "mp_host", f"-> mp_host = {data['mp_host']!r}"))
    elif isinstance(host, str) and "://" in host:
        raise UpstreamKeyError("mp_host", f"must be a host name or address (tcp:// is implied), "
                                          f"got {_show(host)}; the daemon listens on TCP only")
    extra = data.get("extra_config")
    if extra is None:
        data.pop("extra_config", None)
        return data, rows, {}
    if not isinstance(extra, dict):
        raise UpstreamKeyError("extra_config", f"must be a mapping of LMCache keys, got "
                                               f"{type(extra).__name__}; e.g. extra_config: "
                                               "{lmcache.mp.mq_timeout: 10}")
    used: dict[str, Any] = {}
    for key, value in extra.items():
        if key not in MP_KEYS:
            raise UpstreamKeyError("extra_config", f"unknown key {_show(key)}; lmcache 0.5.6 "
                                   f"reads no such key: remove it or fix its spelling (known: "
                                   f"{', '.join(sorted(MP_KEYS))})")
        row = MP_KEYS[key](f"extra_config.{key}", value, data)
        rows.append(row)
        if row.target:
            used[key] = value
    data["extra_config"] = used
    return data, rows, {r.target: r.key for r in rows if r.target and r.key != r.target}
