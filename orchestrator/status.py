"""`loadback status`: how a running deployment is, read from its /metrics (`run`; tests call
`parse`, `summarize`, `report` and `render`). One set of lines per process where the endpoint
labels each process's series apart (vLLM's /metrics: `loadback_process`), one otherwise.
Only the standard library, prometheus_client's text parser and the metrics package's names are
imported: no torch, no SGLang.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from lmcache_loadback.metrics.snapshots import PROCESS_LABEL, TAKEN_AT

from .exit_codes import EXIT_OK, EXIT_UNAVAILABLE

#: metrics.port's default (the YAML's `metrics:` section); TP rank r serves on port + r.
DEFAULT_URL = "http://127.0.0.1:9464/metrics"  # = cli.DEFAULT_STATUS_URL
#: loadback_breaker_state's values (metrics.instruments.BREAKER_STATES, inverted).
BREAKER_NAMES = {0: "closed", 1: "half_open", 2: "open"}

Samples = dict[str, list[tuple[dict[str, str], float]]]


class StatusUnavailable(Exception):
    """The endpoint could not be read, or it serves no loadback_* series."""


def fix_hint(url: str, why: str) -> str:
    """The one-line error: the URL, why, and the fix."""
    return (f"cannot read loadback metrics at {url}: {why}; start the engine with "
            "`metrics: {enabled: true}` in its loadback YAML (SGLang's scheduler or vLLM's "
            "worker rank r serves on metrics.port + r), or SGLang with --enable-metrics, and "
            "pass --url http://HOST:PORT/metrics")


def fetch(url: str, timeout_s: float = 5.0) -> str:
    """The exposition text at `url`; StatusUnavailable (one line, naming the URL and the
    fix) when it cannot be read."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        raise StatusUnavailable(fix_hint(url, f"HTTP {exc.code} {exc.reason}")) from None
    except urllib.error.URLError as exc:
        raise StatusUnavailable(fix_hint(url, str(exc.reason))) from None
    except (OSError, ValueError) as exc:  # timeouts, resets, a malformed URL
        raise StatusUnavailable(fix_hint(url, str(exc) or type(exc).__name__)) from None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise StatusUnavailable(fix_hint(url, "the reply is not Prometheus text")) from None


def parse(text: str) -> Samples:
    """{sample name: [(labels, value), ...]} of every loadback_* sample in `text` (the
    Prometheus text format; OpenMetrics' `# EOF` tolerated)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    try:
        for family in text_string_to_metric_families(text.replace("\n# EOF", "\n")):
            for s in family.samples:
                if s.name.startswith("loadback_"):
                    out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    except ValueError as exc:
        raise StatusUnavailable(f"not Prometheus text ({exc})") from None
    return out


def by_process(samples: Samples) -> dict[str, Samples]:
    """The samples of each process where they carry `PROCESS_LABEL` (vLLM's /metrics: the
    scheduler and each worker rank, named `rank0 (engine 1)` when vLLM runs several engines),
    else {"": samples}: summed together, a gauge of several processes means nothing (two
    ranks' breakers, one open, read 4)."""
    keyed = [(lab.get("engine", ""), lab.get(PROCESS_LABEL, ""))
             for rows in samples.values() for lab, _ in rows]
    if not any(process for _, process in keyed):
        return {"": samples}
    several = len({engine for engine, _ in keyed}) > 1
    out: dict[str, Samples] = {}
    for (engine, process) in sorted(set(keyed), key=_process_order):
        name = (process or "unlabelled") + (f" (engine {engine})" if several else "")
        out[name] = {}
        for sample, rows in samples.items():
            mine = [(lab, v) for lab, v in rows
                    if (lab.get("engine", ""), lab.get(PROCESS_LABEL, "")) == (engine, process)]
            if mine:
                out[name][sample] = mine
    return out


def _process_order(key: tuple[str, str]) -> tuple:
    """The scheduler first, then the ranks in numeric order, per engine."""
    engine, process = key
    rank = process[4:] if process.startswith("rank") else ""
    return (engine, process != "scheduler", int(rank) if rank.isdigit() else -1, process)


def _one(samples: Samples, name: str, **labels: str) -> float | None:
    """The value of `name{labels}` (summed over any other labels), None when absent."""
    rows = [v for lab, v in samples.get(name, ()) if all(lab.get(k) == w for k, w in labels.items())]
    return sum(rows) if rows else None


def _int(x: float | None) -> int | None:
    return None if x is None else int(x)


def summarize(samples: Samples, *, url: str, now: float | None = None) -> dict[str, Any]:
    """The status fields from parsed samples; None where the series is absent."""
    now = time.time() if now is None else now
    info = [(lab, v) for lab, v in samples.get("loadback_daemon_info", ()) if v > 0]
    up = _one(samples, "loadback_daemon_up")
    epoch = _one(samples, "loadback_registered_epoch")
    breaker = _one(samples, "loadback_breaker_state")
    modes = [lab.get("mode") for lab, v in samples.get("loadback_transfer_mode", ()) if v > 0]
    live = {lab.get("state", ""): int(v) for lab, v in samples.get("loadback_live_prefixes", ())}
    degraded = {lab.get("reason", ""): int(v) for lab, v in
                samples.get("loadback_prefix_outcomes_total", ()) if lab.get("state") == "degraded"}
    waits = _one(samples, "loadback_scheduler_wait_seconds_count")
    wait_sum = _one(samples, "loadback_scheduler_wait_seconds_sum")
    taken_at = _one(samples, TAKEN_AT)
    return {
        "url": url,
        "l2_canary": _canary(samples, now),
        # vLLM's /metrics: how old this process's snapshot is (None: live series)
        "snapshot_age_s": None if taken_at is None else round(max(0.0, now - taken_at), 3),
        "daemon": {
            "endpoint": ", ".join(sorted({lab.get("endpoint", "?") for lab, _ in info})) or None,
            "transfer_setting": ", ".join(sorted({lab.get("transfer", "?") for lab, _ in info}))
            or None,
            "up": None if up is None else up > 0,
            # loadback_daemon_refused{reason} at 1: registration refused (a mismatch)
            "refused": sorted(lab.get("reason", "") for lab, v in
                              samples.get("loadback_daemon_refused", ()) if v > 0),
        },
        # -1: not registered now; None: the deployment does not export it
        "registration_epoch": _int(epoch),
        "breaker": None if breaker is None else BREAKER_NAMES.get(int(breaker), str(breaker)),
        "transfer_mode": ", ".join(sorted(m for m in modes if m)) or None,
        "live_prefixes": {"total": sum(live.values()), "by_state": live} if live else None,
        "owed_releases": _int(_one(samples, "loadback_owed_releases")),
        "queues": {
            "lookup": _int(_one(samples, "loadback_lookup_queue_depth")),
            "store": _int(_one(samples, "loadback_store_queue_depth")),
            "store_limit": _int(_one(samples, "loadback_store_queue_limit")),
            "stores_skipped": _int(_one(samples, "loadback_stores_skipped_total")),
        },
        "fences_dropped": _int(_one(samples, "loadback_fences_dropped_total")),
        "scheduler_wait": None if not waits else {
            "calls": int(waits), "mean_ms": round((wait_sum or 0.0) / waits * 1000, 3)},
        "last_refusal": _last_refusal(samples, degraded, now),
        "degraded_total": sum(degraded.values()) if degraded else None,
    }


def _last_refusal(samples: Samples, degraded: dict[str, int], now: float
                  ) -> dict[str, Any] | None:
    """The latest degrade (its reason, when, how many so far) or skipped LOOKUP, whichever
    came last; None when there was neither."""
    last = [(v, lab.get("reason", "")) for lab, v in
            samples.get("loadback_last_degraded_timestamp_seconds", ()) if v > 0]
    counts: dict[str, int | None] = dict(degraded)
    skipped_at = max((v for _, v in samples.get("loadback_last_skipped_timestamp_seconds", ())),
                     default=0.0)
    if skipped_at:  # an outage skips LOOKUPs and degrades nothing: it is a refusal too
        last.append((skipped_at, SKIPPED))
        counts[SKIPPED] = _int(_one(samples, "loadback_lookups_total", result="skipped"))
    if not last:
        return None
    at, reason = max(last)
    return {"reason": reason, "at": at, "ago_s": round(max(0.0, now - at), 3),
            "count": counts.get(reason)}


def _canary(samples: Samples, now: float) -> dict[str, Any] | None:
    """The L2 canary's fields (`loadback_l2_canary_*`); None when the deployment has none."""
    interval = _one(samples, "loadback_l2_canary_interval_seconds")
    if interval is None:
        return None
    checks = {lab.get("result", ""): int(v) for lab, v in
              samples.get("loadback_l2_canary_checks_total", ())}
    last_ok = _one(samples, "loadback_l2_canary_last_success_timestamp_seconds") or 0.0
    return {"interval_s": interval, "checks": checks,
            "consecutive_failures": _int(_one(samples, "loadback_l2_canary_consecutive_failures")),
            "last_ok_ago_s": round(max(0.0, now - last_ok), 3) if last_ok else None}


def _render_canary(c: dict[str, Any] | None) -> str:
    if c is None:
        return "n/a"
    checks = c["checks"]
    failed = sum(v for k, v in checks.items() if k not in ("ok", "unchecked"))
    if not c["interval_s"] and not sum(checks.values()):
        return ("off (l2.canary_interval_ms 0, no mp_http_port, or a daemon without "
                "--l2-adapter)")
    ago = c["last_ok_ago_s"]
    last = "never" if ago is None else f"{ago:.0f} s ago"
    if c["consecutive_failures"]:
        kinds = ", ".join(f"{checks[k]} {k.replace('_', ' ')}" for k in
                          ("lost", "wrong_bytes", "timeout") if checks.get(k))
        return (f"FAILING: {c['consecutive_failures']} checks in a row (last ok {last}); "
                f"{kinds} so far: stores may not reach L2")
    if ago is None:
        return f"no check made yet ({checks.get('unchecked', 0)} unchecked)"
    return f"ok {last} (every {c['interval_s']:g} s; {checks.get('ok', 0)} ok, {failed} failed)"


#: The last refusal's reason when it was a LOOKUP skipped (`loadback_lookups_total{result}`).
SKIPPED = "skipped"
_SKIPPED_SAYS = "skipped: no LOOKUP sent, breaker open, not registered or L2 stalled"


def report(samples: Samples, *, url: str, now: float | None = None) -> dict[str, Any]:
    """`summarize` of the endpoint, or where it labels its series by process, of each process
    apart: {"url", "processes": {name: fields}}."""
    groups = by_process(samples)
    if list(groups) == [""]:
        return summarize(samples, url=url, now=now)
    return {"url": url, "processes": {
        name: {k: v for k, v in summarize(group, url=url, now=now).items() if k != "url"}
        for name, group in groups.items()}}


#: Said under the title of a report per process: where those series come from.
PER_PROCESS_SAYS = "one set per process, as it last shipped them (vLLM ships while it runs steps)"


def _na(x: object) -> str:
    return "n/a" if x is None else str(x)


def render(st: dict[str, Any]) -> str:
    """The human table: one set of lines, or one per process under its name."""
    title = f"loadback status of {st['url']}"
    if "processes" not in st:
        rows = _rows(st)
        width = max(len(k) for k, _ in rows)
        return "\n".join([title] + [f"  {k:<{width}}  {v}" for k, v in rows])
    sets = {name: _rows(fields) for name, fields in st["processes"].items()}
    width = max(len(k) for rows in sets.values() for k, _ in rows)
    lines = [title, f"  {PER_PROCESS_SAYS}"]
    for name, rows in sets.items():
        lines.append(f"  process {name}")
        lines += [f"    {k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def _rows(st: dict[str, Any]) -> list[tuple[str, str]]:
    d = st["daemon"]
    daemon = _na(d["endpoint"])
    extra = []
    if d["up"] is not None:
        extra.append("up" if d["up"] else "DOWN")
    if d["refused"]:
        extra.append(f"REFUSED at registration: {', '.join(d['refused'])}")
    if d["transfer_setting"]:
        extra.append(f"transfer setting {d['transfer_setting']}")
    if extra:
        daemon += f" ({'; '.join(extra)})"
    epoch = st["registration_epoch"]
    reg = "n/a" if epoch is None else "not registered" if epoch < 0 else f"epoch {epoch}"
    live = st["live_prefixes"]
    live_s = "n/a" if live is None else str(live["total"]) + (
        " (" + ", ".join(f"{k} {v}" for k, v in live["by_state"].items() if v) + ")"
        if live["total"] else "")
    q = st["queues"]
    store = _na(q["store"])
    if q["store_limit"] is not None:
        store += f" of {q['store_limit']}"
    if q["stores_skipped"]:
        store += f" ({q['stores_skipped']} skipped at the bound)"
    w = st["scheduler_wait"]
    wait = "n/a (no call timed yet)" if w is None else f"{w['calls']} calls, mean {w['mean_ms']:.1f} ms"
    r = st["last_refusal"]
    if r is not None:
        why = _SKIPPED_SAYS if r["reason"] == SKIPPED else r["reason"]
        refusal = f"{why} ({r['ago_s']:.0f} s ago; {_na(r['count'])} so far)"
    elif st["degraded_total"] == 0:
        refusal = "none"
    else:
        refusal = "n/a"
    rows = [
        ("daemon", daemon),
        ("registration", reg),
        ("breaker", _na(st["breaker"])),
        ("transfer mode", st["transfer_mode"] or (
            "not chosen yet (chosen at registration)" if epoch == -1 else "n/a")),
        ("live prefixes", live_s),
        ("owed releases", _na(st["owed_releases"])),
        ("lookup queue", _na(q["lookup"])),
        ("store queue", store),
        ("fences dropped", _na(st["fences_dropped"])),
        ("scheduler wait", wait),
        ("last refusal", refusal),
        ("l2 canary", _render_canary(st.get("l2_canary"))),
    ]
    if st.get("snapshot_age_s") is not None:
        rows.append(("snapshot", f"{st['snapshot_age_s']:.0f} s old"))
    return rows


def status(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    try:
        samples = parse(fetch(url, timeout_s))
    except StatusUnavailable as exc:
        if str(exc).startswith("cannot read"):
            raise
        raise StatusUnavailable(fix_hint(url, str(exc))) from None
    if not samples:
        raise StatusUnavailable(fix_hint(url,
            "it serves no loadback_* series (is SGLang's --radix-cache-backend loadback, or "
            "vLLM's kv_connector LoadBackConnector, on?)"))
    return report(samples, url=url)


def run(args) -> int:
    """The endpoint is this product's own /metrics server (`metrics.enabled`; TP rank r serves
    on `metrics.port + r`) or SGLang's (`--enable-metrics`, which carries every rank's
    `loadback_*` series through its multiprocess collector). Every field comes from one series
    (docs/operations.md, "Metrics"); one the endpoint lacks (an older deployment) prints as
    "n/a". Exit 0 once the endpoint was read, 69 (EX_UNAVAILABLE) when it could not be, or
    when it serves no `loadback_*` series at all."""
    try:
        st = status(args.url, args.timeout_s)
    except StatusUnavailable as exc:
        print(f"loadback status: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    print(json.dumps(st, indent=2, sort_keys=True) if args.json else render(st))
    return EXIT_OK
