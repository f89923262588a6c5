"""Tensor and pipeline parallel over torch.distributed (gloo on CPU, NCCL on CUDA): who this rank is, its
collectives, the layer split between stages, and the start of the other ranks. Imports nothing of ours
above `config`; the layers use its tensor-parallel group, the engine the rest."""
