"""Test-only stub of torchvision.transforms: InterpolationMode is a real enum (used in module-level
tables); every callable raises."""
import enum

from _sglang_test_stub import module_getattr


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


__getattr__ = module_getattr(__name__)

from . import functional, v2  # noqa: E402
