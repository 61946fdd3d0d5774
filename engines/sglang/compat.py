"""Thin per-version shims where SGLang 0.5.20 and 0.5.23 differ in what the cache answers
(0.5.20: `device_indices`, `(slots, node)`; 0.5.23: `device_prefix_len`, `(tokens, node)`,
checkpoint + on_release). The API is detected from SGLang's own classes; the version string
only gates start-up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata

import torch

SUPPORTED_SGLANG = ("0.5.20", "0.5.23")
ALLOW_UNTESTED_ENV = "LOADBACK_ALLOW_UNTESTED_SGLANG"


class UnsupportedSGLang(RuntimeError):
    """The installed sglang is not one this backend was tested with."""


def sglang_version() -> str:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        import sglang

        return getattr(sglang, "__version__", "unknown")


def dp_rank() -> int:
    """This scheduler's data-parallel replica, 0 without data parallelism. SGLang 0.5.23
    records it in the scheduler's runtime context at start (`get_parallel().dp_rank`, None
    without a DP controller); SGLang's router passes `SGLANG_DP_RANK` instead, which 0.5.20's
    scheduler reads too."""
    try:
        from sglang.srt.runtime_context import get_parallel

        rank = get_parallel().dp_rank
    except Exception:  # not published (class-level use), or a release that has no such name
        rank = None
    if rank is None:
        rank = os.environ.get("SGLANG_DP_RANK")
    try:
        return max(int(rank or 0), 0)
    except ValueError:
        return 0


def allow_untested(config) -> bool:
    """The operator's opt-in: `sglang.allow_untested` in the YAML, else the env variable
    (read once, at construction)."""
    section = getattr(config, "sglang", None)
    if section is not None and getattr(section, "allow_untested", False):
        return True
    return os.environ.get(ALLOW_UNTESTED_ENV, "").strip().lower() in ("1", "true", "yes")


def check_version(version: str, *, allowed: bool) -> None:
    if version in SUPPORTED_SGLANG or allowed:
        return
    raise UnsupportedSGLang(
        f"--radix-cache-backend loadback: sglang {version} is untested (supported: "
        f"{', '.join(SUPPORTED_SGLANG)}); install one of those, or opt in with "
        f"`sglang: {{allow_untested: true}}` in the --lmcache-config-file YAML or "
        f"{ALLOW_UNTESTED_ENV}=1 in the server's environment")


@dataclass(frozen=True)
class Shim:
    """What differs between the supported releases, as data plus three small functions."""

    #: True from 0.5.21 on: MatchResult carries device_prefix_len, init_load_back answers an
    #: int, finished requests go through checkpoint/on_release, LOOKUPs are prefetched.
    prefix_len_api: bool
    device: torch.device

    def device_len(self, result) -> int:
        if self.prefix_len_api:
            return int(result.device_prefix_len)
        return int(result.device_indices.numel())

    def path_indices(self, cache, result) -> torch.Tensor:
        """Device slots of a base match, root to its last device node."""
        if self.prefix_len_api:
            path = cache.path_device_indices(result.last_device_node)
            return path[: result.device_prefix_len]
        return result.device_indices

    def with_host_hit(self, result, tokens: int):
        node = result.last_device_node
        return result._replace(last_host_node=node, best_match_node=node,
                               host_hit_length=int(tokens))

    def loaded(self, slots: torch.Tensor, node):
        return (len(slots), node) if self.prefix_len_api else (slots, node)

    def recompute(self, node):
        if self.prefix_len_api:
            return 0, node
        return torch.empty((0,), dtype=torch.int64, device=self.device), node


def detect(device) -> Shim:
    from sglang.srt.mem_cache.base_prefix_cache import MatchResult

    return Shim(prefix_len_api="device_prefix_len" in MatchResult._fields,
                device=torch.device(device))
