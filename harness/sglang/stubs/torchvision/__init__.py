"""Test-only stub of torchvision (see harness/sglang/stubs/_sglang_test_stub.py): importable, raises if called."""
from _sglang_test_stub import module_getattr

__version__ = "0.0.0+stub"
__getattr__ = module_getattr(__name__)

from . import io, transforms  # noqa: E402  (after __getattr__: attribute access must resolve)
