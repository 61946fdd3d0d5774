"""Which thread may release a request: the one running its match or load_back."""

from __future__ import annotations

import functools
from typing import Any, Callable


def owns_release(answer_released: Callable[[Any, Any], Any],
                  answered: Callable[[Any, Any], None] | None = None):
    """While the decorated call (match, load_back) runs for a request id, its thread alone
    may release that id: an abort/finish/close from another thread meanwhile (the hook's
    scheduler thread dropping a LOOKUP its worker still runs, an engine aborting a request
    whose load runs elsewhere) is only recorded and returns at once; it is carried out here
    once the call returned (see `_release`): the prefix ends once, after all the call did.
    `answer_released(prefix or None, result)`: what the call returns then.
    `answered(prefix, result)`: run under the lock when the call's own result is returned
    (no release came meanwhile), before any later release can end the prefix."""

    def wrap(call):
        @functools.wraps(call)
        def owned(self, request_id: str, *args, **kwargs):
            with self._lock:
                owner = request_id not in self._owners  # a nested call defers to its owner
                if owner:
                    self._owners[request_id] = None
            if not owner:
                return call(self, request_id, *args, **kwargs)
            try:
                result = call(self, request_id, *args, **kwargs)
            finally:
                with self._lock:
                    reason = self._owners.pop(request_id)
                    p = self._live.get(request_id)
                    if reason is None and p is not None and answered is not None:
                        answered(p, result)
                if reason is not None:
                    self._release(request_id, reason)
            return result if reason is None else answer_released(p, result)

        return owned

    return wrap
