"""The operator's side on a real SGLang 0.5.23 server (`--radix-cache-backend loadback`,
`--enable-metrics`: the loadback_* series on SGLang's own /metrics).

- A daemon started with another --chunk-size (32; the YAML says 16) is refused: the server
  stays up, every request recomputes with the output of a recompute, its log holds the one
  ERROR naming both values and the fix, /metrics shows loadback_daemon_refused{reason=
  "chunk_size"} 1; the daemon restarted with --chunk-size 16 is accepted and hits begin, with
  no server restart.
- On a healthy server, the YAML edited while it serves is applied from the heartbeat (no
  signal, no restart): loadback_config_generation moves and the new lookup deadline is
  observed (1 us: a stored prompt's LOOKUP times out, loadback_timeouts_total{op="lookup"}
  grows, the request recomputes); a broken edit is refused (generation unchanged, refusal
  counted, one WARNING naming the file) while the server keeps serving; a good edit after it
  applies and hits resume.
"""

from __future__ import annotations

import pytest

from .conftest import report
from .helpers import CHUNK, loaded_tokens, prompt, wait_until
from .test_loadback_server import RECOVERY_BOUND_S, assert_same_output, assert_within_bound

REFUSED = 'loadback_daemon_refused{reason="chunk_size"}'
GENERATION = "loadback_config_generation"
LOOKUP_TIMEOUTS = 'loadback_timeouts_total{op="lookup"}'
RELOAD_FAILURES = "loadback_config_reload_failures_total"


def _one(stack, series: str) -> float:
    values = stack.metric(series)
    return max(values) if values else 0.0


def _log_lines(stack, text: str) -> list[str]:
    return [x for x in stack.server.log_path.read_text(errors="replace").splitlines()
            if text in x]


@pytest.fixture(scope="module")
def mismatched(make_stack):
    return make_stack("loadback", daemon_chunk=2 * CHUNK, metrics=True)


def test_a_daemon_of_another_chunk_size_is_refused_and_every_request_recomputes(mismatched):
    st = mismatched
    fix = (f"--chunk-size {2 * CHUNK}, this config chunk_size {CHUNK}: start the daemon with "
           f"--chunk-size {CHUNK} or set chunk_size: {2 * CHUNK}")
    wait_until(lambda: _log_lines(st, fix), 60, "the refusal's ERROR in the server log")
    wait_until(lambda: _one(st, REFUSED) == 1, 30, "loadback_daemon_refused at 1 on /metrics")
    gens = []
    for _ in range(2):
        ids = prompt(st.new_seed())
        ref = st.generate(ids)
        assert st.server.flush_cache()
        again = st.generate(ids)
        gens += [ref, again]
        assert ref.ok and again.ok and again.output_ids == ref.output_ids
        assert loaded_tokens(again) == 0
    assert_within_bound(gens, "daemon refused")
    assert st.objects() == 0, "a refused daemon was sent a STORE"
    errors = _log_lines(st, "daemon refused")
    # SGLang's log format shows no level: the level is pinned by tests/integration caplog tests
    assert len(errors) == 1 and fix in errors[0], errors
    assert _one(st, "loadback_daemon_up") == 1  # it answers; it is refused, not down

    # The daemon restarted with the config's chunk size: accepted, hits begin, same server.
    st.daemon.chunk_size = CHUNK
    st.daemon.restart()
    took, cycles = st.until_hits(RECOVERY_BOUND_S)
    assert_same_output(cycles)
    assert took <= RECOVERY_BOUND_S, "the daemon with the right chunk size was not accepted"
    assert _one(st, REFUSED) == 0
    assert len(_log_lines(st, "daemon refused")) == 1
    report("ours_chunk_size_refused", error=errors[0].split("] ", 1)[-1][:200],
           refused_latencies_s=[round(g.latency_s, 3) for g in gens],
           accepted_hits_after_restart_s=round(took, 2))


@pytest.fixture(scope="module")
def healthy(make_stack):
    return make_stack("loadback", metrics=True)


def _stored_prompt_hits(st) -> tuple[bool, int]:
    """A new prompt computed (stored), flushed, sent again: (loaded from the daemon, same
    output); asserts the output is the recompute's."""
    ref, again = st.hit_cycle(st.new_seed(), store_wait_s=10.0)
    assert st.stored and ref.ok and again.ok, (ref.error, again.error)
    assert again.output_ids == ref.output_ids
    return loaded_tokens(again) > 0, loaded_tokens(again)


def test_yaml_edits_apply_live_and_a_broken_one_is_refused(healthy):
    st = healthy
    base = st.config_path.read_text()
    took, cycles = st.until_hits(RECOVERY_BOUND_S)
    assert took <= RECOVERY_BOUND_S, "no storage hit on the healthy server"
    assert _one(st, GENERATION) == 1
    timeouts0 = _one(st, LOOKUP_TIMEOUTS)

    # A 1 us lookup deadline: applied from the heartbeat, observed on the next request.
    st.config_path.write_text(base + "deadlines:\n  lookup_ms: 0.001\n")
    applied_s = wait_until(lambda: _one(st, GENERATION) == 2, 15, "generation 2 on /metrics")
    hit, _ = _stored_prompt_hits(st)
    assert not hit, "a 1 us lookup deadline still loaded from the daemon"
    assert _one(st, LOOKUP_TIMEOUTS) > timeouts0, "the new lookup deadline was not observed"
    assert not _log_lines(st, "config reload rejected")

    # A broken edit: refused, counted, logged once; the server keeps serving.
    failures0 = _one(st, RELOAD_FAILURES)
    st.config_path.write_text(base + "deadlines:\n  lookup_ms: -5\n")
    wait_until(lambda: _one(st, RELOAD_FAILURES) == failures0 + 1, 15,
               "the broken edit counted on /metrics")
    ids = prompt(st.new_seed())
    served = st.generate(ids)
    assert served.ok, served.error
    assert _one(st, GENERATION) == 2
    wait_until(lambda: _log_lines(st, "config reload rejected"), 10, "the refusal logged")
    rejected = _log_lines(st, "config reload rejected")
    assert len(rejected) == 1, rejected
    assert str(st.config_path) in rejected[0] and "lookup_ms" in rejected[0]

    # Fixed: applied (generation 3), and with the default deadline hits resume.
    st.config_path.write_text(base + "deadlines:\n  lookup_ms: 50\n")
    wait_until(lambda: _one(st, GENERATION) == 3, 15, "generation 3 on /metrics")
    took, cycles = st.until_hits(RECOVERY_BOUND_S)
    assert_same_output(cycles)
    assert took <= RECOVERY_BOUND_S, "hits did not resume after the deadline was restored"
    assert _one(st, RELOAD_FAILURES) == failures0 + 1
    assert st.server.proc.poll() is None
    report("ours_live_reload", applied_after_s=round(applied_s, 2),
           refused=rejected[0].split("] ", 1)[-1][:200], hits_resumed_s=round(took, 2))
