"""The one place that turns LMCache's usage telemetry off.

An lmcache process posts usage data to the internet unless these variables are set; every
daemon, in-process server, tool and test of this project runs with them. Imports nothing
heavy, so it can run before lmcache (or anything importing it) is imported.
"""

from __future__ import annotations

import os

#: The opt-outs, for the environment of a child process: `dict(os.environ, **QUIET_TELEMETRY)`.
QUIET_TELEMETRY = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}


def quiet_telemetry() -> None:
    """Set the opt-outs in this process's environment, unless the operator set them."""
    for key, value in QUIET_TELEMETRY.items():
        os.environ.setdefault(key, value)
