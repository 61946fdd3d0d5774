"""SGLang radix-cache backend `loadback`: this product behind SGLang's prefix cache.

Who calls what: SGLang's scheduler subprocess runs every entry point in group
`sglang.srt.plugins` (`load_plugins()`), which calls `register()` here; `register()` adds the
factory under the name `loadback`; `--radix-cache-backend loadback` then makes SGLang call
`build_cache(ctx)` once per scheduler, which builds `LoadBackRadixCache` (radix_cache.py).
Nothing in SGLang is edited or patched. sglang is imported only inside these functions, so
`import orchestrator` works where sglang is not installed.
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
    from .radix_cache import LoadBackRadixCache

    return LoadBackRadixCache.from_build_context(ctx)
