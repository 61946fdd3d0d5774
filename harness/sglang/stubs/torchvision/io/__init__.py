"""Test-only stub of torchvision.io: the names SGLang and transformers import at module level."""
import enum

from _sglang_test_stub import module_getattr, raising


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4
    RGBA = 4


decode_jpeg = raising("torchvision.io.decode_jpeg")
decode_image = raising("torchvision.io.decode_image")
read_video = raising("torchvision.io.read_video")
__getattr__ = module_getattr(__name__)
