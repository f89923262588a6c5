"""A mixin for tinyserve's layers and models: calling the module runs forward directly.

Why: nn.Module.__call__ looks for forward hooks and pre-hooks (global and per module) before and after
every forward, and a decode step makes hundreds of module calls (several per layer): at one stream that
was a measurable share of a step (docs/PERFORMANCE.md, "Numbers behind the code's comments"). tinyserve
registers no hooks; hooks registered on these modules would not run.
"""

from __future__ import annotations


class DirectCall:
    """Put first among the bases: `class RMSNorm(DirectCall, nn.Module)`."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)
