"""Test-only stub of torchvision.transforms.v2.functional."""
from _sglang_test_stub import module_getattr

__getattr__ = module_getattr(__name__)
