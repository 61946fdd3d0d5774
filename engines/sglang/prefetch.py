"""The 0.5.23 scheduler's storage surface of LoadBackRadixCache (`--enable-lmcache`): prefetch,
poll, report. None of these may block: the LOOKUP runs on the core's `AsyncLookups` (the
cache's `_worker`). A mixin only because SGLang calls these methods on the cache object itself.
"""

from __future__ import annotations

import logging
import time
from array import array

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from .promises import Promise

log = logging.getLogger("loadback.hook")


class PrefetchHooks:
    """Mixed into LoadBackRadixCache ahead of RadixCache (so `super()` is the radix tree)."""

    def prefetch_from_storage(self, handle, last_host_node=None, new_input_tokens=(),
                              last_hash=None, prefix_keys=None, matched_prefix_tokens=None,
                              extra_key=None, cache_salt=None, storage_hit_end=None, **_):
        """Submit the LOOKUP; never waits (the worker thread runs it)."""
        if self._worker is None or handle in self._lookups or handle in self._promises:
            return
        self._drop_other_attempts(handle)
        local = list(matched_prefix_tokens or [])
        key = RadixKey(array("q", local + list(new_input_tokens)), extra_key,
                       cache_salt=cache_salt).page_aligned(self.page_size)
        device_len = min(len(local) // self.page_size * self.page_size, len(key))
        self._submit(handle, key, self._salt(extra_key, cache_salt), device_len)

    def _submit(self, handle, key, salt: str, device_len: int, *, relookups: int = 0) -> bool:
        """Hand a LOOKUP to the worker (voiding the request's earlier promise); False when
        the daemon could add less than a chunk, so there is nothing to ask, or when the
        worker already holds its bound of LOOKUPs (the request recomputes)."""
        self._drop(handle, abort=True)
        ids = array("q", key.raw_token_ids()[: len(key)])
        if len(ids) - device_len < self.chunk_size:
            return False
        p = Promise(self._next_id(handle), ids, salt, device_len, relookups=relookups,
                     key=RadixKey(array("q", ids), key.extra_key, cache_salt=key.cache_salt))
        # match may also prepare the retrieve (shm); the LOOKUP may wait for L2
        budget = self.config.deadlines.match_s(
            len(ids) - device_len, prepare=self.config.prepare_at_match,
            lookup_s=self.orch.lookup_wait_s(len(ids), device_len))
        job = self._worker.submit(p.request_id, p.token_ids, device_len, salt,
                                  time.monotonic() + budget + 0.05, record=p)
        if job.skipped:
            return False
        self._lookups[handle] = job
        return True

    def check_prefetch_progress(self, handle) -> bool:
        """False while the LOOKUP may still answer in time; never blocks."""
        job = self._lookups.get(handle)
        if job is None:
            p = self._promises.get(handle)
            if self._worker is not None and p is not None and p.tokens > 0 \
                    and p.relookups < 3:
                device_len = self.shim.device_len(
                    super().match_prefix(MatchPrefixParams(key=p.key)))
                if device_len != p.local_tokens:
                    # The radix hit moved while the request waited: derive the promise
                    # again off this thread, and skip the request until it is answered.
                    return not self._submit(handle, p.key, p.salt, device_len,
                                            relookups=p.relookups + 1)
            return True
        tokens = self._worker.answer(job)
        if tokens is None:
            return False
        del self._lookups[handle]
        job.record.tokens = tokens
        self._promises[handle] = job.record
        self._checked(handle, job.record)
        return True

    def terminate_prefetch(self, handle) -> None:
        self._drop(handle, abort=True)

    def pop_prefetch_loaded_span(self, handle) -> tuple[int, int | None]:
        """The daemon's share of the prefix (SGLang reports it as the storage hit)."""
        p = self._promises.get(handle)
        if p is None or p.tokens <= 0:
            return 0, None
        return p.tokens, p.local_tokens

    def pop_prefetch_loaded_tokens(self, handle) -> int:
        return self.pop_prefetch_loaded_span(handle)[0]

    def clear_storage_backend(self) -> bool:
        """/clear_hicache_storage: the daemon is shared with other engines; never cleared here."""
        log.warning("loadback: clearing the LMCache daemon from SGLang is not supported")
        return False

    def is_backuped(self, node) -> bool:
        return True  # the daemon keys by tokens: any device node anchors a lookup

    def is_root(self, node) -> bool:
        return node is self.root_node

    def get_last_hash_value(self, node):
        return None

    def get_prefix_hash_values(self, node):
        return []

    @property
    def hicache_storage_pass_prefix_keys(self) -> bool:
        return False

    def check_hicache_events(self) -> None:
        """Loads complete inside init_load_back; stores that went through unlock here."""
        self._drain_stores(safe_point=True)

    def ready_to_load_host_cache(self) -> int:
        return -1

    @property
    def lookup_queue_depth(self) -> int:
        """LOOKUPs handed to the worker and not yet completed (queued or running)."""
        worker = getattr(self, "_worker", None)
        return worker.depth if worker is not None else 0

    @property
    def store_queue_depth(self) -> int:
        """STOREs queued or running; each holds a tree lock until a pass drains it."""
        worker = getattr(self, "_store_worker", None)
        return worker.depth if worker is not None else 0

    def has_pending_cache_operations(self) -> bool:
        self._drain_stores()
        return bool(self._lookups or self._stores)
