"""Hot reload: policy values change live; a bad file changes nothing and is counted. Inside
the engine the file is watched from the heartbeat (ConfigWatcher), never by a signal."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import torch

from lmcache_loadback.connectors.kv_layout import KVLayout
from lmcache_loadback.testing.memory import InMemoryConnector
from lmcache_loadback.orchestrator import LoadBackConfig, LoadBackOrchestrator
from lmcache_loadback.orchestrator.reload import ConfigReloader, ConfigWatcher
from tests.conftest import make_pool


@pytest.fixture
def orch():
    layout = KVLayout(num_layers=1, num_heads=2, head_dim=8, dtype=torch.float16, chunk_size=16)
    o = LoadBackOrchestrator(LoadBackConfig.from_dict({"chunk_size": 16}), InMemoryConnector(layout),
                             kv_pool=make_pool(layout, 64), start_heartbeat=False)
    yield o
    o.close()


def gen(o):
    return o.metrics.snapshot()["loadback_config_generation"]


def failures(o):
    return o.metrics.snapshot()["loadback_config_reload_failures_total"]


def test_reload_swaps_policies_and_bumps_generation(orch, tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("chunk_size: 16\ndeadlines:\n  lookup_ms: 7\nbreaker:\n  cooldown_ms: 9\n"
                 "break_even:\n  min_tokens: 32\n")
    r = ConfigReloader(orch, f, install_sighup=False)
    assert gen(orch) == 1
    assert r.reload_now()
    assert orch.config.deadlines.lookup_ms == 7
    assert orch.breaker.policy.cooldown_ms == 9 and orch.break_even.policy.min_tokens == 32
    assert gen(orch) == 2


@pytest.mark.parametrize("text", ["deadlines:\n  lookup_ms: -1\n", "chunk_size: 16\nbogus: 1\n",
                                  "chunk_size: 16\nmp_port: 7777\n", "[unclosed\n"])
def test_bad_or_restart_only_change_keeps_the_old_config(orch, tmp_path, text, caplog):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    before = orch.config
    assert not ConfigReloader(orch, f, install_sighup=False).reload_now()
    assert orch.config is before and gen(orch) == 1 and failures(orch) == 1
    assert "config reload rejected" in caplog.text


def test_sighup_reloads(orch, tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("chunk_size: 16\nretries:\n  max_attempts: 1\n")
    r = ConfigReloader(orch, f)
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        end = time.monotonic() + 5
        while time.monotonic() < end and orch.config.retries.max_attempts != 1:
            time.sleep(0.01)
        assert orch.config.retries.max_attempts == 1 and gen(orch) == 2
    finally:
        r.close()


@pytest.mark.parametrize("data", [
    b"chunk_size: 16\nmodel_name: caf\xe9\n",                      # not UTF-8
    b"chunk_size: 16\ndeadlines: " + b"[" * 500 + b"]" * 500 + b"\n",  # nested 500 deep
    b"chunk_size: 16\ndeadlines:\n  lookup_ms: .inf\n",
    b"chunk_size: 16\nchunk_size: 16\n",
    b"chunk_size: 16\nextra_config:\n  lmcache.mp.mq_timeout: soon\n",
    b"chunk_size: 16\nmp_host: ''\n",
])
def test_hostile_file_is_refused_and_counted(orch, tmp_path, data, caplog):
    f = tmp_path / "c.yaml"
    f.write_bytes(data)
    before = orch.config
    assert ConfigReloader(orch, f, install_sighup=False).reload_now() is False
    assert orch.config is before and gen(orch) == 1 and failures(orch) == 1
    assert f"config reload rejected, generation 1 stays in force: {f}: " in caplog.text


def test_reload_thread_survives_a_bad_file_on_sighup(orch, tmp_path):
    """SIGHUP with a non-UTF-8 file: counted; the next SIGHUP with a good file still applies."""
    f = tmp_path / "c.yaml"
    f.write_bytes(b"chunk_size: 16\nretries:\n  max_attempts: \xff\n")
    r = ConfigReloader(orch, f)
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        end = time.monotonic() + 10
        while time.monotonic() < end and failures(orch) < 1:
            time.sleep(0.01)
        assert failures(orch) == 1 and gen(orch) == 1
        f.write_text("chunk_size: 16\nretries:\n  max_attempts: 1\n")
        os.kill(os.getpid(), signal.SIGHUP)
        while time.monotonic() < end and gen(orch) < 2:
            time.sleep(0.01)
        assert orch.config.retries.max_attempts == 1 and gen(orch) == 2 and failures(orch) == 1
    finally:
        r.close()


def test_unexpected_error_in_reload_is_counted_not_raised(orch, tmp_path, monkeypatch):
    f = tmp_path / "c.yaml"
    f.write_text("chunk_size: 16\n")

    def broken(path):
        raise RuntimeError("validation bug")

    monkeypatch.setattr(LoadBackConfig, "from_yaml", staticmethod(broken))
    assert ConfigReloader(orch, f, install_sighup=False).reload_now() is False
    assert failures(orch) == 1 and gen(orch) == 1


# -- ConfigWatcher: the file watched from the heartbeat (inside SGLang: no signal) ----------


class Ticks:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _edit(f, text):
    """Write `text` with an mtime that differs from the last write's (coarse clocks)."""
    before = f.stat().st_mtime_ns if f.exists() else 0
    f.write_text(text)
    os.utime(f, ns=(before + 10**9, before + 10**9))


def test_watcher_applies_a_changed_file_once_per_heartbeat_from_the_tick(orch, tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("chunk_size: 16\n")
    clock, applied = Ticks(), []
    w = ConfigWatcher(orch, f, on_apply=applied.append, clock=clock)
    orch.on_tick(w.check)
    _edit(f, "chunk_size: 16\ndeadlines:\n  lookup_ms: 3\n")
    orch.tick()  # less than one heartbeat interval since the last look: not read
    assert gen(orch) == 1 and applied == []
    clock.t += orch.config.heartbeat.interval_ms / 1000
    orch.tick()
    assert gen(orch) == 2 and orch.config.deadlines.lookup_ms == 3
    assert applied == [orch.config]
    clock.t += 10
    os.utime(f, ns=(f.stat().st_mtime_ns + 10**9,) * 2)  # touched, same content: no reload
    orch.tick()
    assert gen(orch) == 2 and len(applied) == 1


def test_watcher_refuses_a_bad_edit_once_at_warning_and_keeps_serving(orch, tmp_path, caplog):
    f = tmp_path / "c.yaml"
    f.write_text("chunk_size: 16\n")
    w = ConfigWatcher(orch, f)
    _edit(f, "chunk_size: 16\ndeadlines:\n  lookup_ms: -5\n")
    for _ in range(3):
        assert w.check(force=True) in (False, None)
    refused = [r for r in caplog.records if "config reload rejected" in r.getMessage()]
    assert len(refused) == 1 and refused[0].levelno == logging.WARNING
    assert str(f) in refused[0].getMessage() and "lookup_ms" in refused[0].getMessage()
    assert gen(orch) == 1 and failures(orch) == 1
    _edit(f, "chunk_size: 16\ndeadlines:\n  lookup_ms: 5\n")  # fixed: applies
    assert w.check(force=True) is True and gen(orch) == 2 and failures(orch) == 1


def test_watcher_survives_the_file_disappearing(orch, tmp_path, caplog):
    f = tmp_path / "c.yaml"
    f.write_text("chunk_size: 16\n")
    w = ConfigWatcher(orch, f)
    f.unlink()
    assert w.check(force=True) is False and w.check(force=True) is False
    assert failures(orch) == 1 and gen(orch) == 1
    assert len([r for r in caplog.records if "cannot be read" in r.getMessage()]) == 1
    _edit(f, "chunk_size: 16\nretries:\n  max_attempts: 1\n")
    assert w.check(force=True) is True and orch.config.retries.max_attempts == 1


def test_tp_reload_stages_collective_keys_until_every_rank_offers_them(orch):
    """Under TP the keys that change which collectives `match` makes (break_even.min_tokens,
    prepare_at_match) wait for the group; every other key applies at once."""
    from lmcache_loadback.orchestrator.tp_reload import AgreedReload, digest, values_of

    agreed = AgreedReload(orch)
    before = agreed.offered()
    new = LoadBackConfig.from_dict({"chunk_size": 16, "prepare_at_match": False,
                                    "deadlines": {"lookup_ms": 7},
                                    "break_even": {"min_tokens": 4096}})
    applied = agreed.offer(new)
    assert applied.deadlines.lookup_ms == orch.config.deadlines.lookup_ms == 7
    assert orch.config.break_even.min_tokens == 0 and orch.config.prepare_at_match
    assert orch.break_even.policy.min_tokens == 0
    mine = agreed.offered()
    assert mine == digest(values_of(new)) != before
    assert agreed.settle(before, mine) is None        # a peer still holds the old values
    assert orch.config.break_even.min_tokens == 0
    adopted = agreed.settle(mine, mine)               # every rank holds them: adopted
    assert adopted is orch.config
    assert (adopted.break_even.min_tokens, adopted.prepare_at_match) == (4096, False)
    assert orch.break_even.policy.min_tokens == 4096 and adopted.deadlines.lookup_ms == 7
    assert agreed.settle(mine, mine) is None and agreed.offered() == mine
