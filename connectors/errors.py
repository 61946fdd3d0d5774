"""Errors of the daemon side, grouped by what a caller can do about them; callers catch by
meaning, never by message. `ConnectorError`: timeout, unavailable (or version skew), an
untrustworthy answer (short read, dropped request), a refusal. `SlotsError` and
`UnsupportedKVPool` (both ValueError) are the caller's own mistakes.
"""

from __future__ import annotations


class ConnectorError(Exception):
    """Base of every error raised while talking to the LMCache daemon."""

    #: Whether repeating the same call can succeed (used by retry policies). What the
    #: daemon is owed after a failure is never carried here: a retrieve's `Retrieval`
    #: (connectors/retrieval.py) records it.
    retry_safe: bool = False


class DaemonTimeout(ConnectorError):
    """The daemon did not answer before the caller's deadline."""

    retry_safe = True

    def __init__(self, op: str, waited_s: float, detail: str = "") -> None:
        self.op = op
        self.waited_s = waited_s
        msg = f"{op}: no reply from the LMCache daemon within {waited_s * 1000:.1f} ms"
        super().__init__(f"{msg} ({detail})" if detail else msg)


class PrefetchPending(DaemonTimeout):
    """The daemon answered the LOOKUP and every poll of it, but its prefetch (the copy from
    its L2 store into memory) was still running when the wait ended: the daemon is alive,
    its L2 store was slow or hung."""


class DaemonUnavailable(ConnectorError):
    """No connection to the daemon could be used before the deadline."""

    retry_safe = True


class VersionSkew(DaemonUnavailable):
    """The endpoint accepts connections but never answers this client's protocol.

    LMCache MP daemons of another version silently drop requests whose key layout
    they cannot decode, so a version mismatch looks like a timeout on registration.
    """

    retry_safe = False


class ProtocolError(ConnectorError):
    """The daemon's answer is malformed or unsafe; it is discarded, never used."""


class ShortRead(ProtocolError):
    """The daemon sent fewer KV chunks than the range it was asked for."""


class RequestDropped(ProtocolError):
    """The daemon answered a request sent after this one but never this one: it dropped it
    (its handler raised, or it cannot decode this protocol)."""


class DaemonRejected(ConnectorError):
    """The daemon answered and refused (e.g. success=False on prepare_retrieve)."""


class SlotsError(ValueError):
    """KV slots passed by the engine do not match the tokens they must hold."""


class UnsupportedKVPool(ValueError):
    """The engine's KV pool (its model's attention kind, or its device) is not one this
    product can load and store byte-exact; raised at construction, saying what to do."""
