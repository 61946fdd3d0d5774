"""Test-only stub of torchvision.transforms.functional."""
from _sglang_test_stub import module_getattr, raising
from torchvision.transforms import InterpolationMode  # noqa: F401  (re-exported like the real one)

pil_to_tensor = raising("torchvision.transforms.functional.pil_to_tensor")
__getattr__ = module_getattr(__name__)
