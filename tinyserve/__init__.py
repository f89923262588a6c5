"""tinyserve: an LLM inference server written from scratch on PyTorch tensors.

`from tinyserve import LLM, SamplingParams` is the offline API; LLM is imported on first use so that
`import tinyserve.types` (the shared vocabulary) stays free of torch.
"""

from tinyserve.types import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from tinyserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'tinyserve' has no attribute {name!r}")
