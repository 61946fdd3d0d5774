"""The places `connectors.wire.OP_PLACES` says the 0.5.6 daemon serves each op in are the
ones lmcache's own handler declarations give (the fences of unanswered calls rely on it)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from lmcache_loadback.connectors import wire


def lmcache_places() -> dict[str, str]:
    import lmcache.v1.multiprocess.modules as modules
    from lmcache.v1.multiprocess.request_handler import HandlerType, get_request_handler_options

    places: dict[str, str] = {}
    for info in pkgutil.iter_modules(modules.__path__):
        mod = importlib.import_module(f"{modules.__name__}.{info.name}")
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ != mod.__name__:
                continue
            for name, fn in inspect.getmembers(cls, callable):
                opts = get_request_handler_options(fn)
                if opts is None:
                    continue
                op = opts.operation or name
                place = ("inline" if opts.handler_type is HandlerType.SYNC else
                         "affinity" if opts.requires_client_affinity else "cpu")
                places[op] = place
    return places


def test_op_places_match_lmcache_handler_declarations():
    theirs = lmcache_places()
    ours = {op: place for op, place in wire.OP_PLACES.items()}
    assert {op: theirs.get(op) for op in ours} == ours
    assert set(wire.OP_IDS) <= set(ours)  # every op this client sends has a known place
