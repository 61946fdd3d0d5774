"""Test-only stub of vllm._custom_ops: RotaryEmbedding binds `rotary_embedding` from it as a
fallback when no CUDA is found; the torch path is what runs on CPU, so every name raises if called."""
from _sglang_test_stub import module_getattr, raising

rotary_embedding = raising("vllm._custom_ops.rotary_embedding")
__getattr__ = module_getattr(__name__)
