"""Models shipped for examples, tests and benchmarks."""

from .gpt import GPT, GPT_PRESETS, GPTConfig

__all__ = ["GPT", "GPTConfig", "GPT_PRESETS"]
