"""Models a user brings (``models: [tests.plugins.user_models:shared_blocks]``), and broken builders.

``shared_blocks`` is a small causal language model whose two middle blocks share one weight (the
classic trap for a flat-buffer ZeRO: one tensor reached from two stage-3 units) and whose head is tied
to the token embedding; it follows the contract in ``zbench.cases.model_source``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, WIDTH = 128, 16, 32


class Block(nn.Module):
    """A residual causal-mixing block: each position adds a projection of the running mean of the ones before."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
        running_mean = x.cumsum(dim=1) / steps
        return x + torch.tanh(self.mix(self.norm(running_mean)))


class SharedBlocksLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vocab_size, self.max_seq_len = VOCAB, SEQ
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(4))
        self.blocks[2].mix.weight = self.blocks[1].mix.weight  # one weight, two blocks
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied input/output embedding

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def shared_blocks(seed: int) -> nn.Module:
    return SharedBlocksLM()


def no_blocks(seed: int) -> nn.Module:
    """The same model without a ``blocks`` list (one stage-3 unit; nothing to checkpoint)."""
    model = SharedBlocksLM()
    model.layers = model.blocks
    del model.blocks
    model.forward = lambda idx, targets: _forward_layers(model, idx, targets)  # type: ignore[method-assign]
    return model


def _forward_layers(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    x = model.embed(idx)
    for block in model.layers:
        x = block(x)
    logits = model.head(model.norm(x)).float()
    return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def not_a_module(seed: int) -> object:
    return {"weights": []}


def no_data_contract(seed: int) -> nn.Module:
    return nn.Linear(4, 4)


NOT_CALLABLE = 3
