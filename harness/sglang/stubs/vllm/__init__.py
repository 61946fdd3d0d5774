"""Test-only stub of vllm: only `vllm._custom_ops` exists (see harness/sglang/stubs/_sglang_test_stub.py)."""
