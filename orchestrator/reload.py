"""Hot reload of policy values from the YAML file, on SIGHUP and through `reload_now()`.

An invalid new file is rejected with a logged error naming the key and the fix; the config
in force stays; `loadback_config_reload_failures_total` counts it and
`loadback_config_generation` only moves on success.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

from .config import ConfigError, LoadBackConfig
from .core import LoadBackOrchestrator

log = logging.getLogger("loadback")


class ConfigReloader:
    def __init__(self, orch: LoadBackOrchestrator, path: str | Path, *,
                 install_sighup: bool = True) -> None:
        self.orch = orch
        self.path = Path(path)
        self._lock = threading.Lock()
        self._previous = None
        if install_sighup:
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError("SIGHUP reload must be installed from the main thread; "
                                   "pass install_sighup=False and call reload_now() instead")
            self._previous = signal.signal(signal.SIGHUP, self._on_sighup)

    def _on_sighup(self, signum, frame) -> None:
        # Reading and validating YAML is not for a signal handler: hand it to a thread.
        threading.Thread(target=self.reload_now, name="loadback-reload", daemon=True).start()

    def reload_now(self) -> bool:
        """Re-read the file and apply it; False (old config kept) when it is rejected."""
        with self._lock:
            try:
                cfg = LoadBackConfig.from_yaml(self.path)
                self.orch.reload(cfg)
            except ConfigError as exc:
                log.error("config reload rejected, generation %d stays in force: %s",
                          self.orch.generation, exc)
                self.orch.metrics.config_reload_failed()
                return False
            except Exception as exc:  # a validation bug must not end the reload thread
                log.error("config reload failed unexpectedly, generation %d stays in force: "
                          "%s: %s", self.orch.generation, type(exc).__name__, exc)
                self.orch.metrics.config_reload_failed()
                return False
            log.info("config generation %d loaded from %s", self.orch.generation, self.path)
            return True

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGHUP, self._previous)
            self._previous = None
