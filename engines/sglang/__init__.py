"""SGLang radix-cache backend `loadback`: the `sglang.srt.plugins` entry point calls `register()`,
which adds the factory under that name; `--radix-cache-backend loadback` then builds
`LoadBackRadixCache` through `build_cache(ctx)`. Nothing in SGLang is patched, and sglang is
imported only inside these functions.
"""

from __future__ import annotations

import logging

from .compat import SUPPORTED_SGLANG

log = logging.getLogger("loadback.hook")
BACKEND_NAME = "loadback"

__all__ = ["BACKEND_NAME", "SUPPORTED_SGLANG", "build_cache", "register"]


def register() -> None:
    """Entry point (`sglang.srt.plugins`): register the `loadback` radix-cache backend."""
    from sglang.srt.mem_cache.registry import (
        get_radix_cache_factory,
        register_radix_cache_backend,
    )

    if get_radix_cache_factory(BACKEND_NAME) is build_cache:
        return  # load_plugins() may run twice in one process
    register_radix_cache_backend(BACKEND_NAME, build_cache)


def build_cache(ctx):
    """Radix-cache factory: SGLang passes its `TreeCacheBuildContext`."""
    from .flags import check_flags
    from .radix_cache import LoadBackRadixCache

    check_flags(ctx)  # the server's flags before anything is built
    return LoadBackRadixCache.from_build_context(ctx)
