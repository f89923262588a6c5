"""Copy checkpoint tensors into a model, strictly: every parameter (and every shard of a merged one)
filled exactly once with the right shape, no tensor left over. Errors name the tensor."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from tinyserve.layers.linear import MergedLinear
from tinyserve.loader.errors import ModelLoadError
from tinyserve.loader.names import to_param_name

# A checkpoint tensor: its Hugging Face name and a function producing it (lazily, so at most one
# tensor's temporary copy exists at a time).
NamedTensor = tuple[str, Callable[[], torch.Tensor]]


def _expected_slots(model: nn.Module) -> dict[tuple[str, int | None], str]:
    """Every (parameter, shard) the checkpoint must provide -> a readable name for errors."""
    slots = {}
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if isinstance(module, MergedLinear):
                for shard in range(len(module.output_sizes)):
                    slots[(full, shard)] = f"{full}[shard {shard}]"
            else:
                slots[(full, None)] = full
    return slots


def _target(model: nn.Module, param_name: str, shard: int | None) -> torch.Tensor:
    module_name, _, attr = param_name.rpartition(".")
    module = model.get_submodule(module_name)
    param = getattr(module, attr)
    if shard is None:
        return param.data
    start, size = module.shard_offset(shard)
    return param.data.narrow(0, start, size)


def load_weights(model: nn.Module, tensors: Iterable[NamedTensor], ignore: Callable[[str], bool] = lambda _: False) -> None:
    """Fill `model` (already materialized on its device and dtype) from checkpoint tensors."""
    packed = getattr(model, "packed_modules", {})
    missing = _expected_slots(model)
    for hf_name, produce in tensors:
        if ignore(hf_name):
            continue
        param_name, shard = to_param_name(hf_name, packed)
        if (param_name, shard) not in missing:
            seen = "loaded twice" if param_name in dict(model.named_parameters()) else "unexpected"
            raise ModelLoadError(f"tensor {hf_name!r} is {seen} for {type(model).__name__}")
        target = _target(model, param_name, shard)
        tensor = produce()
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(tensor)
        del missing[(param_name, shard)]
    if missing:
        names = sorted(missing.values())
        more = f" (and {len(names) - 5} more)" if len(names) > 5 else ""
        raise ModelLoadError(f"checkpoint is missing tensor(s): {', '.join(names[:5])}{more}")
