"""The RETRIEVE side of the daemon client: prepare_retrieve (at match, or per piece of a
pipelined load), validate, land the chunks in the slots; every call's debt recorded in the
caller's `Retrieval` as it goes out."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Sequence

import torch

from . import wire
from .base import Prepared, Retrieved
from .errors import DaemonRejected, DaemonUnavailable, ProtocolError, ShortRead, SlotsError
from .gpu_transfer import on_cuda
from .kv_copy import scatter_skipping
from .kv_layout import KVPool, check_slots
from .retrieval import CommitBehind, Retrieval
from .safe_decode import load_tensor_list

#: One msgpack bin holds < 4 GiB: a pickled reply or store must stay under it (with framing).
PICKLE_MAX_BYTES = 2**32 - (64 << 20)
log = logging.getLogger(__name__)


class RetrieveCalls:
    """Mixed into `LMCacheMPConnector` (its `_call`, `key`, `transfer`, mapping and GPU path)."""

    def prepare(self, token_ids: Sequence[int], request_id: str, *, start: int, end: int,
                timeout_s: float, cache_salt: str = "",
                retrieval: Retrieval | None = None) -> Prepared:
        """prepare_retrieve of [start, end) now, the copy later (`retrieve_into(prepared=)`).

        The daemon moves the lookup's read locks on those chunks to this transfer and hands
        out where they are (shm) or their bytes (pickle); they stay put until the commit
        that `retrieval` (the caller's, made before this call) then owes is paid: after the
        copy when it loads, at once when it does not. Done at match time it takes the
        daemon's round trip off the load's critical path. Raises like `retrieve_into`;
        whatever the daemon is owed after a raise is in `retrieval`.
        """
        r = self._retrieval_for(start, end, retrieval)
        self._check_pickle_size(end - start)
        first, *rest = self._prepare_plan(end - start)
        upto = start + first * self.chunk_size
        if rest:  # the load asks for the rest: until it does, their locks are r's to free
            r.owe_rest(lambda s, e, t: self.free_locks(token_ids, request_id, s, e, t,
                                                       cache_salt=cache_salt, shard=r.shard))
        key = self.key(token_ids, request_id, start=start, end=upto, cache_salt=cache_salt)
        chunks = self._prepare_range(key, first, timeout_s, r)
        return Prepared(start=start, end=end, chunks=chunks, retrieval=r,
                        transfer=self.transfer, rest=tuple(rest))

    def _prepare_plan(self, tokens: int) -> list[int]:
        """Pieces of a range prepared at match: with `prepare_in_pieces` on a GPU with shared
        memory the first piece of `piece_plan` (the load asks for the rest while it copies
        that one), else all."""
        n_chunks = tokens // self.chunk_size
        if self.force_prepare_pieces is not None:
            return self.force_prepare_pieces(n_chunks)
        if self.prepare_in_pieces and self._gpu is not None and self.transfer == "shm":
            return self.piece_plan(n_chunks)
        return [n_chunks]

    def _retrieval_for(self, start: int, end: int, retrieval: Retrieval | None) -> Retrieval:
        """The caller's retrieval of exactly [start, end), or a new one on this epoch."""
        if retrieval is None:
            return Retrieval(self.epoch, start, end)
        if (retrieval.start, retrieval.end) != (start, end):
            raise ValueError(f"retrieval of [{retrieval.start}, {retrieval.end}) used for "
                             f"[{start}, {end})")
        return retrieval

    def _prepare_range(self, key: wire.CacheKey, n_chunks: int, timeout_s: float,
                       retrieval: Retrieval) -> list[torch.Tensor]:
        """One prepare_retrieve: its validated chunks. `retrieval` records the call's commit
        whenever the daemon may serve it, answered or not: abandoned at the deadline and
        served later, it parks the range's read locks (shm) until a commit_retrieve of the
        same key. Paid after the daemon answered the abandoned call, the commit releases
        them; if it was never served, or refused, the commit finds no transfer and releases
        nothing (in pickle mode it never does). Not sent (DaemonUnavailable, or
        TransferBusy: the same range is outstanding from this instance) or refused
        (DaemonRejected): the locks stay the lookup's, nothing is recorded."""
        deadline = time.monotonic() + timeout_s
        claim = self._claim_identity(key, timeout_s)
        commit = self._owed_commit(key, claim)
        due = None if claim is None else lambda: self.outstanding.mark_due(
            self._identity(key), claim)
        try:
            reply = self._call("prepare_retrieve", [key, self.instance_id],
                               max(0.0, deadline - time.monotonic()),
                               request_id=key.request_id)
        except (DaemonUnavailable, DaemonRejected):
            self._release_identity(key, claim)
            raise
        except BaseException:
            retrieval.asked(key.end, commit, due)  # sent: the daemon may serve it still
            raise
        if reply is None or not reply.success:
            self._release_identity(key, claim)  # refused: the daemon parked nothing
            raise DaemonRejected(
                f"prepare_retrieve [{key.start}, {key.end}) refused: the lookup locks are gone "
                "(expired, freed, or the daemon restarted)"
            )
        retrieval.asked(key.end, commit, due)
        return self._validated_chunks(reply, n_chunks)

    @staticmethod
    def _identity(key: wire.CacheKey) -> tuple:
        """The fields 0.5.6's key equality compares (request_id and the readers are not)."""
        return (key.model_name, key.world_size, key.worker_id, key.token_ids, key.start,
                key.end, key.cache_salt)

    def _claim_identity(self, key: wire.CacheKey, wait_s: float) -> object | None:
        """Shared memory only (pickle parks nothing): mark the key outstanding until its
        commit is answered, or raise TransferBusy (`Outstanding`: waits up to `wait_s` only
        for a commit already handed over)."""
        if self.transfer != "shm":
            return None
        return self.outstanding.claim(self._identity(key), self.epoch, wait_s)

    def _release_identity(self, key: wire.CacheKey, claim: object | None) -> None:
        if claim is not None:
            self.outstanding.release(self._identity(key), claim)

    def retrieve_into(
        self,
        token_ids: Sequence[int],
        request_id: str,
        pool: KVPool,
        slots: torch.Tensor,
        *,
        start: int,
        end: int,
        timeout_s: float,
        skip: int = 0,
        cache_salt: str = "",
        prepared: Prepared | None = None,
        retrieval: Retrieval | None = None,
    ) -> Retrieved:
        """Copy tokens [start + skip, end) into `slots`; [start, end) is chunk-aligned and
        locked by a lookup of `request_id` (or already prepared: `prepared`, from
        `prepare` of exactly [start, end), whose retrieval this one is); `skip` leading
        tokens are already cached by the engine.

        validate -> copy -> return. commit_retrieve is not sent here: `retrieval` (the
        caller's, or a new one) records it as prepare_retrieve goes out, and the caller
        pays it off the request path (`Retrieved.commit` is its release). The shm views
        stay valid until that commit, so copying before it is sound.

        A CUDA pool on shared memory is loaded in pieces (`piece_plan`): the copy of one
        piece runs while the next piece's prepare_retrieve is in flight. A piece that fails
        after earlier pieces were queued waits for them (nothing writes the slots after the
        raise); the retrieval then owes the sent pieces' commits and the free of the pieces
        never asked for (the caller frees none of the range: `locks_moved`). Whatever
        reached the slots before a failure is not a load: the caller recomputes.
        """
        if prepared is not None:
            if retrieval is not None and retrieval is not prepared.retrieval:
                raise ValueError("a prepared range is retrieved under its own retrieval")
            retrieval = prepared.retrieval
        self._check_retrieve(pool, slots, start, end, skip, prepared)
        r = self._retrieval_for(start, end, retrieval)
        nbytes = (end - start) // self.chunk_size * self.layout.chunk_bytes
        if prepared is not None:
            if prepared.epoch != self.epoch:  # r owes the old incarnation: dropped, counted
                raise DaemonUnavailable("the daemon restarted after prepare_retrieve: its "
                                        "locks and buffers are gone")
            check = lambda: self._check_slots(pool, slots, skip)  # noqa: E731
            if prepared.rest:  # prepared in part: the rest in pieces behind its copy
                ready = self._retrieve_pieces(
                    token_ids, request_id, pool, slots, timeout_s, skip, cache_salt,
                    [len(prepared.chunks), *prepared.rest], r, first=prepared.chunks,
                    check=check)
            else:
                ready = self._land(pool, prepared.chunks, slots, skip, prepared.transfer,
                                   check=check)
            return Retrieved(nbytes=nbytes, commit=r.release, ready=ready)
        self._check_pickle_size(end - start)
        ready = self._retrieve_pieces(token_ids, request_id, pool, slots, timeout_s, skip,
                                      cache_salt, self._plan(pool, end - start), r)
        return Retrieved(nbytes=nbytes, commit=r.release, ready=ready)

    def _plan(self, pool: KVPool, tokens: int) -> list[int]:
        """Chunks per prepare_retrieve of a load: pieces for a CUDA pool on shared memory
        (or as `force_pieces` says), else the whole range in one."""
        n_chunks = tokens // self.chunk_size
        if self.force_pieces is not None:
            return self.force_pieces(n_chunks)
        if on_cuda(pool) and self.transfer == "shm":
            return self.piece_plan(n_chunks)
        return [n_chunks]

    def _check_retrieve(self, pool: KVPool, slots: torch.Tensor, start: int, end: int,
                        skip: int, prepared: Prepared | None) -> None:
        """Refuse bad arguments before anything is sent or copied. A prepared CUDA load
        checks the slots themselves while its first copy runs (before any scatter)."""
        if not 0 <= skip < self.chunk_size:
            raise ValueError(f"skip must be in [0, {self.chunk_size}), got {skip}")
        if prepared is not None and (prepared.start, prepared.end) != (start, end):
            raise ValueError(f"prepared range [{prepared.start}, {prepared.end}) is not the "
                             f"requested [{start}, {end})")
        if len(slots) != end - start - skip:
            raise SlotsError(f"retrieve of [{start}+{skip}, {end}) needs "
                             f"{end - start - skip} slots, got {len(slots)}")
        if not (prepared is not None and on_cuda(pool)):
            self._check_slots(pool, slots, skip)

    def _land(self, pool: KVPool, chunks, slots, skip: int, transfer: str, check=None):
        """Copy validated chunks into the slots: the CUDA path (returns `ready`; `check`,
        the slot checks, runs before its first scatter) or the host scatter (None)."""
        if on_cuda(pool):  # the commit is paid once `ready` completed (the copy read it)
            return self._gpu_for(pool).load(self.layout, chunks, pool, slots, skip,
                                            from_segment=transfer == "shm",
                                            before_scatter=check)
        scatter_skipping(self.layout, chunks, pool, slots, skip)
        return None

    @staticmethod
    def piece_plan(n_chunks: int) -> list[int]:
        """Chunks per prepare_retrieve of a pipelined load: 4, 8, 16, then 32 at a time.

        Every call (prepare_retrieve, commit_retrieve) costs a round trip plus a share that
        grows with the prefix: its key carries the token ids up to the piece's end, which
        both ends encode and the daemon copies into the request's session (the session keeps
        the chunk hashes, so a piece hashes only its own chunks). Up to 16 chunks the copies
        cannot hide the extra round trips, so no pipelining; past it, growing pieces
        (`loadback bench gpu` measures it, with the daemon's cost per operation; "The GPU
        data path" in docs/gpu.md).
        """
        if n_chunks <= 16:
            return [n_chunks]
        plan, size, left = [], 4, n_chunks
        while left:
            take = min(size, left)
            if 0 < left - take < size // 2:  # fold a small tail into this piece
                take = left
            plan.append(take)
            left -= take
            size = min(size * 2, 32)
        return plan

    def _retrieve_pieces(self, token_ids, request_id, pool, slots, timeout_s, skip,
                         cache_salt, plan, retrieval: Retrieval, first=None, check=None):
        """One prepare_retrieve per piece of `plan` (one piece: the whole range; `first`:
        the first piece's chunks, prepared already), each piece copied while the next round
        trip is in flight, and on a GPU each piece's commit paid once its copy completed
        (`CommitBehind`); returns the last copy's `ready`. `check` runs before the first
        piece's scatter."""
        deadline = time.monotonic() + timeout_s
        c = self.chunk_size
        ready, s, row = None, retrieval.start, 0
        gpu = self._gpu_for(pool) if on_cuda(pool) else None
        behind = CommitBehind(retrieval) if gpu is not None and self.commit_behind else None
        try:
            for i, cnt in enumerate(plan):
                e = s + cnt * c
                lead = skip if i == 0 else 0
                rows = e - s - lead
                if i == 0 and first is not None:
                    chunks = first
                else:
                    key = self.key(token_ids, request_id, start=s, end=e, cache_salt=cache_salt)
                    left = max(0.0, deadline - time.monotonic())
                    chunks = self._prepare_range(key, cnt, left, retrieval)
                    if behind is not None:
                        behind.pay_landed(max(0.0, deadline - time.monotonic()))
                ready = self._land(pool, chunks, slots[row:row + rows], lead, self.transfer,
                                   check=check if i == 0 else None)
                if behind is not None:
                    behind.landed(e, ready)
                del chunks
                s, row = e, row + rows
        except BaseException:
            self._fail_pieces(gpu, retrieval, token_ids, request_id, cache_salt)
            raise
        return ready

    def _fail_pieces(self, gpu, retrieval: Retrieval, token_ids, request_id,
                     cache_salt: str) -> None:
        """A load failed: nothing may write the slots after the raise, and once any piece
        may have moved the lookup's locks, the retrieval also owes the free of the pieces
        never asked for, [asked_to, end) (the caller frees none of the range; a load in one
        piece has none left)."""
        s, e = retrieval.asked_to, retrieval.end
        if retrieval.locks_moved and s < e and not retrieval.rest_owed:
            retrieval.owe("free_locks", s, e, lambda t: self.free_locks(
                token_ids, request_id, s, e, t, cache_salt=cache_salt, shard=retrieval.shard))
        if gpu is not None:
            gpu.drain()

    def _check_pickle_size(self, tokens: int) -> None:
        """Refuse, before anything is sent, a pickle message the wire cannot carry."""
        nbytes = tokens * self.layout.bytes_per_token
        if self.transfer == "pickle" and nbytes > PICKLE_MAX_BYTES:
            raise ProtocolError(
                f"{tokens} tokens are {nbytes} bytes, over the {PICKLE_MAX_BYTES}-byte limit "
                "of one pickle message: use shared memory (start the daemon with --shm-name "
                "NAME --no-l1-use-lazy, transfer auto or shm) or move fewer tokens at once")

    def _check_slots(self, pool: KVPool, slots: torch.Tensor, skip: int) -> None:
        """Refuse bad slots before prepare_retrieve: after it a raise would owe a commit,
        and a skip copies in two steps that must not fail between them."""
        head = self.chunk_size - skip if skip else 0
        if head:
            check_slots(dataclasses.replace(self.layout, chunk_size=head), slots[:head], head,
                        pool_size=pool.num_slots)
        check_slots(self.layout, slots[head:], len(slots) - head, pool_size=pool.num_slots)

    def _owed_commit(self, key: wire.CacheKey,
                     claim: object | None = None) -> Callable[[float], bool]:
        """commit_retrieve for `key`, unsent: releases the daemon's buffer and read locks
        (shm) once paid. An answered commit is paid whatever it says: 0.5.6 answers
        True even for a transfer it never created (an abandoned prepare never served, or
        refused), and a refusal would be no different sent again. Answered, it ends the
        key's `claim` (one that raised may still be served: the key stays outstanding)."""

        def commit(timeout_s: float) -> bool:
            ok = self._call("commit_retrieve", [key, self.instance_id], timeout_s,
                            request_id=key.request_id)
            self._release_identity(key, claim)
            if self.transfer == "shm" and not ok:
                log.debug("commit_retrieve [%d, %d) of %s refused: nothing to release",
                          key.start, key.end, key.request_id)
            return True

        return commit

    def _validated_chunks(self, reply: wire.PrepareRetrieveReply,
                          n_chunks: int) -> list[torch.Tensor]:
        """The reply's chunks, each of the layout's shape and dtype, exactly `n_chunks`."""
        if self.transfer == "shm":
            chunks = self._shm_views(reply.context, n_chunks)
        else:
            chunks = load_tensor_list(
                reply.data, expected_shape=self.layout.chunk_shape,
                expected_dtype=self.layout.dtype, max_items=n_chunks,
            )
        if len(chunks) != n_chunks:
            raise ShortRead(f"prepare_retrieve returned {len(chunks)} of {n_chunks} chunks")
        return chunks
