"""The KV layout `loadback tune` measures with: one rank's share of the served model, read from
a Hugging Face config.json (`--model-config`) or a running SGLang server (`--server`).
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

from lmcache_loadback.connectors.kv_layout import KVLayout

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class LayoutError(ValueError):
    """The model config (or server) gives no usable KV layout; the message names the fix."""


@dataclass(frozen=True)
class ModelLayout:
    """One rank's KV layout of the served model, and where it was read."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    source: str

    def kv_layout(self, chunk_size: int) -> KVLayout:
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, DTYPES[self.dtype],
                        chunk_size)

    def describe(self) -> str:
        return (f"{self.num_layers} layers x {self.num_kv_heads} KV heads x {self.head_dim} "
                f"head_dim {self.dtype}")


def layout_from_model_config(path: str | os.PathLike, tp_size: int = 1,
                             kv_dtype: str | None = None) -> ModelLayout:
    """Read one rank's KV layout from a Hugging Face config.json (text models, MHA/GQA)."""
    fix = "pass the model's config.json (--model-config DIR/config.json)"
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise LayoutError(f"model config {path}: cannot read it as JSON ({exc}); {fix}") from None
    if not isinstance(cfg, dict):
        raise LayoutError(f"model config {path}: expected a JSON object; {fix}")
    cfg = cfg.get("text_config") or cfg  # multimodal configs nest the language model's

    def whole(key: str, value) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise LayoutError(f"model config {path}: {key} is {value!r}, expected a whole "
                              f"number > 0; {fix}")
        return value

    def need(key: str) -> int:
        if key not in cfg:
            raise LayoutError(f"model config {path}: no {key!r}; {fix}")
        return whole(key, cfg[key])

    layers = need("num_hidden_layers")
    heads = need("num_attention_heads")
    kv_heads = whole("num_key_value_heads", cfg.get("num_key_value_heads", heads))
    head_dim = (whole("head_dim", cfg["head_dim"]) if cfg.get("head_dim") is not None
                else need("hidden_size") // heads)
    dtype = kv_dtype if kv_dtype not in (None, "auto") else (
        cfg.get("torch_dtype") or cfg.get("dtype") or "float16")
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise LayoutError(f"model config {path}: KV dtype {dtype!r} is not one of "
                          f"{sorted(DTYPES)}; {fix}")
    if tp_size < 1 or kv_heads % tp_size:
        raise LayoutError(f"--tp-size {tp_size} does not divide num_key_value_heads {kv_heads} "
                          f"of {path}; pass the server's tensor-parallel size")
    return ModelLayout(layers, kv_heads // tp_size, head_dim, dtype,
                       f"{path}" + (f", tp_size {tp_size}" if tp_size > 1 else ""))


def _get_json(url: str, timeout_s: float) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read().decode())


def layout_from_server(url: str, timeout_s: float = 5.0) -> ModelLayout:
    """The layout of the model a running SGLang server serves: /model_info names its model
    directory (config.json is read from there), /server_info gives tp_size and kv_cache_dtype."""
    base = url.rstrip("/")
    try:
        info = _get_json(f"{base}/model_info", timeout_s)
        server = _get_json(f"{base}/server_info", timeout_s)
    except (OSError, ValueError) as exc:
        raise LayoutError(f"--server {url}: cannot read /model_info and /server_info ({exc}); "
                          "pass the URL of a running SGLang server, or --model-config "
                          "config.json") from None
    model_path = info.get("model_path") or server.get("model_path")
    config = Path(str(model_path)) / "config.json"
    if not model_path or not config.is_file():
        raise LayoutError(f"--server {url}: its model {model_path!r} is not a local directory "
                          "with a config.json (a hub name is not read here); pass "
                          "--model-config PATH/config.json")
    tp = server.get("tp_size") or 1
    layout = layout_from_model_config(config, int(tp), server.get("kv_cache_dtype"))
    return ModelLayout(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype,
                       f"{config} (served at {url}, tp_size {tp})")


def resolve_layout(args: argparse.Namespace) -> ModelLayout:
    """The KV layout from --model-config or --server (exactly one is required)."""
    model_config, server = getattr(args, "model_config", None), getattr(args, "server", None)
    if bool(model_config) == bool(server):
        raise LayoutError("tune needs the model's KV layout: pass exactly one of "
                          "--model-config PATH/config.json or --server URL (a running SGLang "
                          "server)")
    if server:
        return layout_from_server(server)
    return layout_from_model_config(model_config, int(getattr(args, "tp_size", 1) or 1))
