"""A STORE whose prepare_store went unanswered (`connectors/store.py`) finishes only a
reservation the daemon's late reply made, once, with the bytes it kept; with no reply, or a
reply that reserved nothing, it sends nothing (so it never commits slots nobody wrote)."""

from __future__ import annotations

import torch

from lmcache_loadback.connectors import wire
from lmcache_loadback.connectors.store import Store

KEY = wire.CacheKey(model_name="m", world_size=1, worker_id=0, token_ids=(1, 2), start=0,
                    end=2, request_id="s")
SLOT = wire.ShmSlot(offset=0, length=8, shape=[2, 2], dtype="float16")


def _store(finished: list) -> Store:
    st = Store(0, KEY)
    st.kept = [torch.zeros(2, 2)]
    st.finish = lambda s, ctx, _t: finished.append(list(ctx.chunk_indices))
    return st


def test_no_late_reply_sends_nothing_and_lets_the_copy_go():
    finished: list = []
    st = _store(finished)
    assert st.complete(1.0) and finished == [] and st.kept == []


def test_a_late_reply_that_reserved_nothing_sends_nothing():
    finished: list = []
    st = _store(finished)
    st.answered(wire.encode(wire.PrepareStoreReply()))
    assert st.complete(1.0) and finished == []


def test_a_late_reservation_is_finished_once_with_the_kept_bytes():
    finished: list = []
    st = _store(finished)
    reply = wire.PrepareStoreReply(context=wire.ShmContext(slots=[SLOT], chunk_indices=[0]))
    st.answered(wire.encode(reply))
    assert st.complete(1.0) and st.complete(1.0)
    assert finished == [[0]] and st.kept == []
