"""`loadback status` during an outage: while the breaker is open (or nothing is registered)
requests are skipped without a LOOKUP and no prefix degrades, so the last refusal must come
from the skipped lookups, not from the last degrade before the outage."""

from __future__ import annotations

from prometheus_client import generate_latest

from lmcache_loadback.orchestrator import status
from lmcache_loadback.orchestrator.instruments import product_metrics


def test_the_last_refusal_during_an_outage_is_the_skipped_lookups_not_the_last_degrade():
    now = 1_700_000_000.0
    m = product_metrics()
    clock = iter([now - 600, now - 4, now - 3, now - 2])
    m.wall_clock = lambda: next(clock)
    m.set_daemon_up(False)
    m.breaker("open")
    m.outcome("degraded", "retrieve_timeout", 16)  # ten minutes ago, before the outage
    for _ in range(3):  # the outage: every match skipped, the last 2 s ago
        m.observe_lookup(None, "skipped")
    st = status.summarize(status.parse(generate_latest(m.registry).decode()), url="u", now=now)
    assert st["last_refusal"] == {"reason": "skipped", "at": now - 2, "ago_s": 2.0,
                                  "count": 3}
    table = status.render(st)
    assert ("\n  last refusal    skipped: no LOOKUP sent, breaker open, not registered or L2 stalled "
            "(2 s ago; 3 so far)") in table, table
