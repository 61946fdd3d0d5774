"""Deterministic interleavings for race tests: one thread is held at an exact call (after
what it did before, before that call runs) while the test acts, then let on. No sleeps."""

from __future__ import annotations

import contextlib
import threading


class Stepped:
    """Holds the first call of `obj.name` made by the thread `held` starts."""

    def __init__(self, monkeypatch, obj, name: str, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self.inside, self._go = threading.Event(), threading.Event()
        self.thread: threading.Thread | None = None
        self.out: dict = {}
        real = getattr(obj, name)

        def stepped(*args, **kwargs):
            if threading.current_thread() is self.thread and not self.inside.is_set():
                self.inside.set()
                assert self._go.wait(timeout_s)
            return real(*args, **kwargs)

        monkeypatch.setattr(obj, name, stepped)

    @contextlib.contextmanager
    def held(self, fn):
        """Run `fn` on a thread of its own; the with-body runs while that thread waits at
        the call. On exit it goes on and is joined; `result()` is what `fn` returned."""

        def body():
            try:
                self.out["ret"] = fn()
            except BaseException as exc:  # noqa: BLE001 - reported by result()
                self.out["err"] = exc

        self.thread = threading.Thread(target=body, name="stepped")
        self.thread.start()
        try:
            assert self.inside.wait(self.timeout_s), "the thread never reached the held call"
            yield self
        finally:
            self._go.set()
            self.thread.join(self.timeout_s)

    def result(self):
        assert "err" not in self.out, f"the held thread raised {self.out.get('err')!r}"
        return self.out.get("ret")
