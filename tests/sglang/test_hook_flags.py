"""SGLang start-up flags the backend cannot serve with are refused at construction, in one line
naming the flag. SGLang 0.5.23 refuses --enable-lmcache with either flag itself while parsing
the server arguments; 0.5.20 checks neither, and neither release checks them against
--radix-cache-backend without --enable-lmcache."""

from __future__ import annotations

import dataclasses

import pytest

from .test_hook_behaviour import build_context


@pytest.mark.parametrize("field,flag", [
    ("enable_hierarchical_cache", "--enable-hierarchical-cache"),
    ("disable_radix_cache", "--disable-radix-cache"),
])
def test_conflicting_flag_refused_at_construction_naming_it(tmp_path, field, flag):
    from lmcache_loadback.engines.sglang import build_cache

    cfg = tmp_path / "loadback.yaml"
    cfg.write_text("mp_host: 127.0.0.1\nmp_port: 1\nchunk_size: 16\n")
    with pytest.raises(ValueError) as exc:
        build_cache(dataclasses.replace(build_context(str(cfg)), **{field: True})).close()
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("loadback: ")
    assert flag in msg and f"start without {flag}" in msg, msg
    build_cache(build_context(str(cfg))).close()   # neither flag: built (no daemon there)
