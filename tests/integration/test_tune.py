"""`loadback tune` against a real daemon: the model's KV layout reaches the daemon, the
recommended deadlines sit above what the daemon was measured doing, the YAML loads; clear
exits for a missing daemon, a bad address and a model config without a layout."""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lmcache_loadback.testing.daemon import DaemonProcess, free_port
from lmcache_loadback.orchestrator.config import LoadBackConfig
from lmcache_loadback.harness import tune
from lmcache_loadback.harness.bench.common import LOG_MININTERVAL_S, median, percentile

pytestmark = [pytest.mark.timeout(240)]

# A tiny llama: hidden 64, 4 layers, 4 heads, 2 KV heads, head_dim 16, bf16.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000, "torch_dtype": "bfloat16",
}
TINY_BYTES_PER_TOKEN = 4 * 2 * 16 * 2 * 2  # layers x KV heads x head_dim x bf16 x (K, V)


@pytest.fixture
def model_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return path


def _args(addr: str, out: str, model_config=None, requests: int = 3, **kw) -> argparse.Namespace:
    return argparse.Namespace(daemon=addr, out=out, prefill_tokens_per_s=10000.0,
                              requests=requests, model_config=model_config and str(model_config),
                              server=None, tp_size=1, json=None, **kw)


@pytest.mark.daemon
def test_tune_registers_the_models_layout_and_recommends_above_what_it_measured(
        tmp_path, capsys, model_config):
    d = DaemonProcess(chunk_size=16)
    out, report = tmp_path / "t.yaml", tmp_path / "t.json"
    try:
        d.start()
        args = _args(f"127.0.0.1:{d.port}", str(out), model_config, requests=4)
        args.json = str(report)
        assert tune.run(args) == 0
    finally:
        d.stop()
    measured = json.loads(report.read_text())
    assert measured["layout"] | {"source": None} == {
        "num_layers": 4, "num_kv_heads": 2, "head_dim": 16, "dtype": "bfloat16", "source": None}
    assert measured["bytes_per_token"] == TINY_BYTES_PER_TOKEN
    sizes = measured["sizes"]
    assert [s["tokens"] for s in sizes] == [16, 64, 256, 1024]
    for s in sizes:
        # Every sample was answered by the daemon with the model's bytes, not another layout's.
        assert len(s["lookup_ms"]) == len(s["retrieve_ms"]) == 4 and not s["errors"], s
        assert s["nbytes"] == s["tokens"] * TINY_BYTES_PER_TOKEN

    cfg = LoadBackConfig.from_yaml(out)
    assert (cfg.mp_host, cfg.mp_port, cfg.chunk_size) == ("127.0.0.1", d.port, 16)
    worst_lookup_p99 = max(percentile(s["lookup_ms"], 99) for s in sizes)
    assert cfg.deadlines.lookup_ms > worst_lookup_p99
    for s in sizes:  # the RETRIEVEs of each size, up to their p99, fit the recommended deadline
        deadline_ms = cfg.deadlines.retrieve_s(s["tokens"]) * 1000
        assert deadline_ms >= percentile(s["retrieve_ms"], 99) > 0, s["tokens"]
    biggest = sizes[-1]
    gbps = biggest["nbytes"] / (median(biggest["retrieve_ms"]) / 1000) / 1e9
    assert cfg.break_even.initial_bandwidth_gbps == pytest.approx(gbps, rel=0.01)

    text = out.read_text()
    assert text.startswith("# Tuned by `loadback tune`") and f"127.0.0.1:{d.port}" in text
    assert "4 layers x 2 KV heads x 16 head_dim bfloat16, 512 B/token" in text
    assert str(model_config) in text and "assum" not in text
    captured = capsys.readouterr()
    assert "recommended" in captured.out and "p99 lookup" in captured.out
    # tqdm in a log: the final count, and a handful of redraws rather than one per sample.
    redraws = captured.err.count("\r")
    assert "16/16" in captured.err and redraws <= 2 + tune.WALL_BUDGET_S // LOG_MININTERVAL_S


def test_layout_from_model_config_reads_gqa_head_dim_dtype_and_tp(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    lay = tune.layout_from_model_config(path)
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype) == (4, 2, 16, "bfloat16")
    assert lay.kv_layout(16).bytes_per_token == TINY_BYTES_PER_TOKEN
    assert tune.layout_from_model_config(path, tp_size=2).num_kv_heads == 1
    # No head_dim, no num_key_value_heads (MHA), no dtype: derived as HF does.
    path.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512}))
    lay = tune.layout_from_model_config(path)
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype) == (2, 8, 64, "float16")


@pytest.mark.parametrize("cfg,tp,words", [
    ({k: v for k, v in TINY_LLAMA.items() if k != "num_hidden_layers"}, 1, ["'num_hidden_layers'"]),
    (TINY_LLAMA | {"num_key_value_heads": 0}, 1, ["num_key_value_heads is 0"]),
    (TINY_LLAMA | {"torch_dtype": "float8_e4m3fn"}, 1, ["'float8_e4m3fn'", "bfloat16"]),
    (TINY_LLAMA, 3, ["--tp-size 3", "num_key_value_heads 2"]),
    ("not json", 1, ["cannot read it as JSON"]),
])
def test_a_model_config_without_a_layout_exits_64_naming_file_key_and_fix(tmp_path, capsys, cfg,
                                                                          tp, words):
    path = tmp_path / "config.json"
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    args = _args(f"127.0.0.1:{free_port()}", str(tmp_path / "t.yaml"), path)
    args.tp_size = tp
    assert tune.run(args) == 64
    err = capsys.readouterr().err
    assert str(path) in err and all(w in err for w in words), err
    assert not (tmp_path / "t.yaml").exists()


def test_tune_needs_a_layout_source(tmp_path, capsys):
    assert tune.run(_args(f"127.0.0.1:{free_port()}", str(tmp_path / "t.yaml"))) == 64
    assert "--model-config" in capsys.readouterr().err


class _SGLangInfo(BaseHTTPRequestHandler):
    """Answers /model_info and /server_info with the fields sglang 0.5.23's http_server.py
    returns (a stand-in: starting a real SGLang server is the plugin tests' job)."""

    model_path = ""

    def do_GET(self):  # noqa: N802 - http.server's name
        body = {"/model_info": {"model_path": self.model_path, "is_generation": True},
                "/server_info": {"model_path": self.model_path, "tp_size": 2,
                                 "kv_cache_dtype": "auto"}}.get(self.path)
        self.send_response(200 if body else 404)
        self.end_headers()
        self.wfile.write(json.dumps(body or {}).encode())

    def log_message(self, *a):
        pass


def test_layout_from_a_running_servers_model_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    handler = type("H", (_SGLangInfo,), {"model_path": str(tmp_path)})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        lay = tune.layout_from_server(url)
        assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype) == (4, 1, 16, "bfloat16")
        assert url in lay.source and "tp_size 2" in lay.source
        handler.model_path = "meta-llama/Llama-3.1-8B"  # a hub name: nothing local to read
        with pytest.raises(tune.LayoutError, match="--model-config"):
            tune.layout_from_server(url)
    finally:
        srv.shutdown()
        srv.server_close()
    with pytest.raises(tune.LayoutError, match="running SGLang server"):
        tune.layout_from_server(url, timeout_s=2)


def test_tune_without_a_daemon_exits_69_quickly_naming_the_address(tmp_path, capsys, model_config):
    addr = f"127.0.0.1:{free_port()}"
    out = tmp_path / "t.yaml"
    t0 = time.monotonic()
    assert tune.run(_args(addr, str(out), model_config)) == 69  # EX_UNAVAILABLE, not 2 (invalid config)
    assert time.monotonic() - t0 < 5
    err = capsys.readouterr().err
    assert addr in err and "fix:" in err
    assert not out.exists()


def test_tune_rejects_a_malformed_address(tmp_path, capsys, model_config):
    assert tune.run(_args("localhost", str(tmp_path / "t.yaml"), model_config)) == 64
    assert "HOST:PORT" in capsys.readouterr().err


def test_retrieve_deadlines_cover_every_measured_p99_even_off_the_fitted_line():
    # Small prefixes slow for their size (a fixed cost) and one large one: the least-squares
    # line through the origin passes far below the small sizes' p99.
    sizes = [tune.Size(c, c * 16, lookup_ms=[1.0] * 5, retrieve_ms=[ms] * 5, nbytes=c * 16 * 512)
             for c, ms in ((1, 12.0), (4, 12.0), (16, 12.0), (64, 200.0))]
    _, recs = tune.recommend(sizes, 16, 10000.0)
    got = {k: v for k, v, _ in recs}
    for s in sizes:
        deadline = min(got["deadlines.retrieve_max_ms"], got["deadlines.retrieve_base_ms"]
                       + got["deadlines.retrieve_per_ki_token_ms"] * s.tokens / 1024)
        assert deadline >= s.retrieve_ms[0] * tune.RETRIEVE_FACTOR, (s.tokens, deadline)
    assert got["deadlines.lookup_ms"] >= 1.0 * tune.LOOKUP_FACTOR


def test_fit_is_least_squares_and_never_negative():
    a, b = tune.fit([(1.0, 3.0), (2.0, 5.0), (4.0, 9.0)])
    assert a == pytest.approx(1.0) and b == pytest.approx(2.0)
    assert tune.fit([(1.0, 5.0), (2.0, 4.0)]) == (4.5, 0.0)       # falling: flat at the mean
    a, b = tune.fit([(1.0, 1.0), (2.0, 3.0)])                     # negative intercept: origin
    assert a == 0.0 and b == pytest.approx(7 / 5)
    assert tune.fit([(2.0, 4.0)]) == (0.0, 2.0)                   # one point: proportional


@pytest.mark.daemon
def test_tune_stops_at_its_wall_budget_and_says_so(tmp_path, capsys, monkeypatch, model_config):
    monkeypatch.setattr(tune, "WALL_BUDGET_S", 0.0)
    out = tmp_path / "t.yaml"
    d = DaemonProcess(chunk_size=16)
    try:
        d.start()
        t0 = time.monotonic()
        rc = tune.run(_args(f"127.0.0.1:{d.port}", str(out), model_config, requests=50))
        assert time.monotonic() - t0 < 30
    finally:
        d.stop()
    assert rc == 1 and not out.exists()  # nothing measured: nothing recommended
    captured = capsys.readouterr()
    assert "STOPPED EARLY" in captured.out and "0 s budget" in captured.out
    assert f"127.0.0.1:{d.port}" in captured.err
