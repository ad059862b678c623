"""Models shipped for examples, tests and benchmarks."""

from .gpt import GPT, GPT_PRESETS, GPTConfig
from .vision import VISION_PRESETS, ResNet, ViT, build_vision_model

__all__ = ["GPT", "GPTConfig", "GPT_PRESETS", "ResNet", "ViT", "VISION_PRESETS", "build_vision_model"]
