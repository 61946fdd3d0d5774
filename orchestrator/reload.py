"""Hot reload of policy values from the YAML file: on SIGHUP and through `reload_now()` in a
process of one's own (`ConfigReloader`), and by `ConfigWatcher` inside someone else's (the
SGLang engine: a SIGHUP would end its scheduler). An invalid new file is rejected, logged with
the file, key and fix; the config in force stays and the reload failure is counted.
"""

from __future__ import annotations

import hashlib
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Callable

from .config import ConfigError, LoadBackConfig
from .core import LoadBackOrchestrator
from .tp_reload import AgreedReload

log = logging.getLogger("loadback")


class ConfigReloader:
    """Reload on SIGHUP (installed from the main thread unless `install_sighup=False`) or on
    `reload_now()`. `loadback_config_reload_failures_total` counts rejected files;
    `loadback_config_generation` moves only on success. Under tensor parallelism the keys
    that change which collectives run are only staged here (`agreement`); the engine adopts
    them at a step the ranks agree on (the SGLang backend does, at each scheduler pass)."""

    def __init__(self, orch: LoadBackOrchestrator, path: str | Path, *,
                 install_sighup: bool = True) -> None:
        self.orch = orch
        self.path = Path(path)
        self._lock = threading.Lock()
        self._previous = None
        # Under TP the keys that shape collectives wait for the group (orchestrator.tp_reload).
        self.agreement = AgreedReload(orch) if orch.tp.enabled else None
        if install_sighup:
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError("SIGHUP reload must be installed from the main thread; "
                                   "pass install_sighup=False and call reload_now() instead")
            self._previous = signal.signal(signal.SIGHUP, self._on_sighup)

    def _on_sighup(self, signum, frame) -> None:
        # Reading and validating YAML is not for a signal handler: hand it to a thread.
        threading.Thread(target=self.reload_now, name="loadback-reload", daemon=True).start()

    def reload_now(self, *, level: int = logging.ERROR,
                   on_apply: Callable[[LoadBackConfig], None] | None = None) -> bool:
        """Re-read the file and apply it (then `on_apply(config)`); False (old config kept)
        when it is rejected, logged at `level`."""
        with self._lock:
            try:
                cfg = LoadBackConfig.from_yaml(self.path)
                if self.agreement is not None:
                    cfg = self.agreement.offer(cfg)
                else:
                    self.orch.reload(cfg)
            except ConfigError as exc:
                log.log(level, "config reload rejected, generation %d stays in force: %s",
                        self.orch.generation, exc)
                self.orch.metrics.config_reload_failed()
                return False
            except Exception as exc:  # a validation bug must not end the reload thread
                log.log(level, "config reload of %s failed unexpectedly, generation %d stays "
                        "in force: %s: %s", self.path, self.orch.generation,
                        type(exc).__name__, exc)
                self.orch.metrics.config_reload_failed()
                return False
            if on_apply is not None:
                on_apply(cfg)
            log.info("config generation %d loaded from %s", self.orch.generation, self.path)
            return True

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGHUP, self._previous)
            self._previous = None


class ConfigWatcher:
    """Watches the config file from the orchestrator's heartbeat (`orch.on_tick(w.check)`),
    never from a signal: at most once per heartbeat interval it compares the file's mtime and
    size, and when they moved, its content hash. A changed file is applied like
    `ConfigReloader.reload_now` (then `on_apply(config)`, e.g. the SGLang backend's own copy);
    a bad one is refused, counted, and logged once at WARNING naming the file and the error
    (the same content is not tried again; the next edit is)."""

    def __init__(self, orch: LoadBackOrchestrator, path: str | Path, *,
                 on_apply: Callable[[LoadBackConfig], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self.orch = orch
        self.on_apply = on_apply
        self.clock = clock
        self.reloader = ConfigReloader(orch, self.path, install_sighup=False)
        self._checked_at = clock()
        self._stat, self._digest = self._read()
        self._unreadable: str | None = None

    def _read(self) -> tuple[tuple[int, int] | None, str | None]:
        try:
            st = self.path.stat()
            data = self.path.read_bytes()
        except OSError:
            return None, None
        return (st.st_mtime_ns, st.st_size), hashlib.sha256(data).hexdigest()

    def check(self, *, force: bool = False) -> bool | None:
        """Look at the file (unless one heartbeat interval has not passed since the last
        look, or `force`): None when nothing changed, else whether the change applied."""
        now = self.clock()
        if not force and now - self._checked_at < self.orch.config.heartbeat.interval_ms / 1000:
            return None
        self._checked_at = now
        try:
            st = self.path.stat()
            stat = (st.st_mtime_ns, st.st_size)
            if stat == self._stat:
                return None
            data = self.path.read_bytes()
        except OSError as exc:
            why = f"{type(exc).__name__}: {exc}"
            if why != self._unreadable:
                self._unreadable = why
                log.warning("config file %s cannot be read (%s); generation %d stays in "
                            "force", self.path, why, self.orch.generation)
                self.orch.metrics.config_reload_failed()
            return False
        self._unreadable = None
        self._stat = stat
        digest = hashlib.sha256(data).hexdigest()
        if digest == self._digest:
            return None  # touched, or saved unchanged
        self._digest = digest
        return self.reloader.reload_now(level=logging.WARNING, on_apply=self.on_apply)

    @property
    def agreement(self) -> AgreedReload | None:
        """Under TP: what the engine's per-pass collective carries (None at TP 1)."""
        return self.reloader.agreement
