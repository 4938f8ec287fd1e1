"""The MNIST model, and how its tensors are laid out and split across servers.

`MnistNet` is the class a saved `model.pt` (a state_dict) loads into:

    model = MnistNet()  # 28 x 28 images, 10 classes
    model.load_state_dict(torch.load("artifacts/<job>/model.pt", weights_only=True))

No dropout and no batch norm: a gradient depends only on the weights and the
batch, so synchronous training with averaged gradients equals one process with
the whole batch, which the tests check.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional


class MnistNet(nn.Module):
    """Two 5x5 convolutions (16 and 32 channels, each followed by 2x2 max pooling), then
    128 hidden units: 215k parameters, about 97 % on 1,000 held-out real digits after
    training on 4,000."""

    def __init__(self, rows: int = 28, cols: int = 28, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        self.hidden = nn.Linear(32 * (rows // 4) * (cols // 4), 128)
        self.out = nn.Linear(128, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = functional.max_pool2d(functional.relu(self.conv1(x)), 2)
        x = functional.max_pool2d(functional.relu(self.conv2(x)), 2)
        return self.out(functional.relu(self.hidden(x.flatten(1))))


def partition(sizes: Sequence[int], servers: int) -> list[int]:
    """Which server holds each tensor: whole tensors, largest first to the least loaded
    server (ties: the lower server), so the servers' shares are balanced by size."""
    if servers > len(sizes):
        raise ValueError(
            f"ps={servers} servers but the model has only {len(sizes)} tensors to share out"
        )
    loads = [0] * servers
    owner = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        server = min(range(servers), key=lambda s: (loads[s], s))
        owner[index] = server
        loads[server] += sizes[index]
    return owner


@dataclass
class FlatModel:
    """A model whose parameters and gradients live in one flat float32 buffer each,
    ordered by server, so each server's share is one contiguous slice: pulled into and
    pushed from without a copy."""

    model: nn.Module
    params: torch.Tensor
    grads: torch.Tensor
    slices: list[slice]  # per server: its share of `params` / `grads`
    layouts: list[list[tuple[str, list[int]]]]  # per server: (name, shape) in order

    @classmethod
    def build(cls, model: nn.Module, servers: int) -> FlatModel:
        named = list(model.named_parameters())
        owner = partition([p.numel() for _, p in named], servers)
        order = sorted(range(len(named)), key=lambda i: (owner[i], i))
        total = sum(p.numel() for _, p in named)
        params, grads = torch.empty(total), torch.zeros(total)
        layouts: list[list[tuple[str, list[int]]]] = [[] for _ in range(servers)]
        offset = 0
        for index in order:
            name, param = named[index]
            n = param.numel()
            params[offset : offset + n].copy_(param.detach().reshape(-1))
            param.data = params[offset : offset + n].view_as(param)
            param.grad = grads[offset : offset + n].view_as(param)
            layouts[owner[index]].append((name, list(param.shape)))
            offset += n
        shares = [sum(named[i][1].numel() for i in order if owner[i] == s) for s in range(servers)]
        bounds = list(itertools.accumulate(shares, initial=0))
        slices = [slice(bounds[s], bounds[s + 1]) for s in range(servers)]
        return cls(model, params, grads, slices, layouts)

    def check_grads_in_place(self) -> None:
        """Autograd accumulates into the existing `.grad` tensors; make sure it still does
        (a replaced `.grad` would silently push zeros)."""
        low = self.grads.data_ptr()
        high = low + self.grads.numel() * self.grads.element_size()
        for name, param in self.model.named_parameters():
            if param.grad is None or not low <= param.grad.data_ptr() < high:
                raise RuntimeError(f"the gradient of {name} left the flat buffer")


def server_tensors(model: nn.Module, servers: int, server: int) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs `server` holds, in the order they travel."""
    named = list(model.named_parameters())
    owner = partition([p.numel() for _, p in named], servers)
    return [(name, p.detach()) for i, (name, p) in enumerate(named) if owner[i] == server]
