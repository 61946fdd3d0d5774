"""vLLM's scheduler asks `get_num_new_matched_tokens` on every pass of a waiting request, for
as long as it waits. A hit whose LOOKUP is older than `lease_max_age_ms` is not served: the
daemon's read TTL may end its locks before the load (or the worker's frees), so the request
asks again under a new session, and the old prefix ends `lease_expired`, its locks forfeited.
The age is read on the scheduler orchestrator's clock, moved by the test; the daemon's real
read TTL is 2 s (`--l1-read-ttl-seconds`), so the forfeited locks end by themselves.
"""

from __future__ import annotations

import pytest

from lmcache_loadback.testing.daemon import DaemonProcess

from .conftest import CHUNK
from .mini_engine import MiniEngine
from .test_connector import HIT, PROMPT, released, stored
from .waiting import wait_until

pytestmark = pytest.mark.daemon

TTL_S = 2
AGE_S = 1.0


@pytest.fixture
def ttl_daemon():
    d = DaemonProcess(chunk_size=CHUNK, http=True,
                      extra_args=["--l1-read-ttl-seconds", str(TTL_S)]).start()
    try:
        yield d
    finally:
        d.stop()


def test_a_hit_asked_past_its_lease_age_is_looked_up_again(model_config, ttl_daemon, tmp_path):
    yaml = tmp_path / "loadback.yaml"
    yaml.write_text(
        f"mp_host: 127.0.0.1\nmp_port: {ttl_daemon.port}\nchunk_size: {CHUNK}\n"
        f"daemon_read_ttl_s: {TTL_S}\nlease_max_age_ms: {AGE_S * 1000:g}\n"
        f"prepare_max_age_ms: {AGE_S * 1000:g}\n"
        "deadlines: {lookup_ms: 200, retrieve_max_ms: 2000}\nheartbeat: {interval_ms: 100}\n")
    eng = MiniEngine(model_config, {"loadback.config_file": str(yaml)})
    try:
        assert eng.wait_registered(), "connector never registered with the daemon"
        side = eng.sched.scheduler
        waited, real = [0.0], side.orch.clock
        side.orch.clock = side.orch.calls.clock = lambda: real() + waited[0]
        stored(eng)
        req = eng.request("waiting", PROMPT)
        assert eng.ask(req)[0] == HIT
        assert side._asks["waiting"].session == "waiting#ask1"
        waited[0] = AGE_S + 0.001           # no KV space for it that long: vLLM kept asking
        n, _, nones = eng.ask(req)
        assert nones >= 1 and n == HIT       # not served from the old answer: asked again
        assert side._asks["waiting"].session == "waiting#ask2"
        s = side.orch.metrics.snapshot()
        assert s["loadback_leases_expired_total"] == 1
        assert s["loadback_prefix_outcomes_total{reason=lease_expired,state=degraded}"] == 1
        res = eng.prefill(req, ask=(n, 0, 0))
        assert not res.load_errors and eng.worker.worker.loads_done == 1
        for rid in list(eng.requests):
            eng.finish(eng.requests[rid])
        # the forfeited LOOKUP's locks end with the daemon's TTL; nothing else is held
        wait_until(lambda: released(ttl_daemon), timeout_s=TTL_S + 10,
                   what="daemon holding no lock, session or job")
    finally:
        eng.close()
