"""Test-only stub of torchvision.transforms.v2."""
from _sglang_test_stub import module_getattr

__getattr__ = module_getattr(__name__)

from . import functional  # noqa: E402
