"""Test-only stub of vllm: only `vllm._custom_ops` exists (see tests/sglang/stubs/_sglang_test_stub.py)."""
