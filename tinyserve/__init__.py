"""tinyserve: an LLM inference server written from scratch on PyTorch tensors."""

from tinyserve.types import SamplingParams

__all__ = ["SamplingParams"]
__version__ = "0.1.0"
