"""SGLang server flags this backend cannot serve with, refused at construction in one line that
names the flag. SGLang 0.5.23 refuses both beside --enable-lmcache while parsing its arguments;
0.5.20 does not, and neither release checks them against --radix-cache-backend alone.
"""

from __future__ import annotations

# TreeCacheBuildContext field -> the flag that sets it, and why the backend cannot serve with it.
_CONFLICTS = (
    ("enable_hierarchical_cache", "--enable-hierarchical-cache",
     "SGLang's HiCache host tier and LMCache load-back are mutually exclusive"),
    ("disable_radix_cache", "--disable-radix-cache",
     "loaded KV is attached to the radix tree, so the backend needs it on (SGLang may also "
     "turn it off for some models)"),
)


def check_flags(ctx) -> None:
    """ValueError for the first conflicting flag SGLang's build context shows."""
    for field, flag, why in _CONFLICTS:
        if getattr(ctx, field, False):
            raise ValueError(f"loadback: --radix-cache-backend loadback cannot run with {flag} "
                             f"({why}); start without {flag}")
