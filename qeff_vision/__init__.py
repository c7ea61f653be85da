"""qeff-vision: vision-language export toolchain for Qualcomm Cloud AI 100 with a dynamic vision_size."""

__version__ = "0.1.0"
