"""Model presets by name and the synthetic data every implementation trains on.

The model is a plain GPT (nanoGPT-shaped: token + position embeddings, pre-norm
blocks, a head of its own or, in the ``-tied`` presets, the token embedding's
weight) so a newcomer can read it top to bottom. Presets range from ``tiny``
(seconds on a CPU) to ``gpt-70b``; the big ones exist for planning: their
parameter count is exact (``GPTConfig.num_parameters`` equals what the module
would hold) even where they cannot be built (``zbench.presets``: the
configurations, importable without torch).
"""

from __future__ import annotations

from functools import partial
from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zbench.presets import GPTConfig, get_config

_M = TypeVar("_M", bound=nn.Module)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then a GELU MLP, each with a residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, cfg.ffn_hidden)
        self.out = nn.Linear(cfg.ffn_hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._attend(x)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))

    def _attend(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus its causal self-attention: the half of the block a mixture-of-experts block keeps."""
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    """One expert: the dense block's GELU MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ffn_hidden)
        self.out = nn.Linear(cfg.ffn_hidden, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


def _has_no_values(t: torch.Tensor) -> bool:
    """A fake (tracing) or meta tensor: shapes without data."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.is_meta


def expert_of(idx: torch.Tensor, experts: int) -> torch.Tensor:
    """Each token's expert, fixed by its id in every block (hash routing: Roller et al., "Hash Layers For Large
    Sparse Models", 2021), so routing is identical under every implementation and needs no learning.

    Unbalanced on purpose: the last expert takes token id 0 alone, the others the remaining ids in turn. A rank
    whose micro-batch lacks id 0 runs that expert on no token and its parameters get no gradient there: idle on
    one rank (DDP averages the others' gradients with this rank's zeros) or on every rank (no gradient at all,
    and AdamW leaves the expert untouched): the two cases a sharded engine must treat as DDP does.
    """
    return torch.where(idx == 0, experts - 1, idx % (experts - 1))


class MoEBlock(Block):
    """The block with ``cfg.experts`` MLPs in place of one; each token goes through the one ``expert_of`` names, and
    an expert no token reaches is not run at all (its parameters get no gradient on this rank)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        del self.fc, self.out
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(cfg.experts))

    def forward(self, x: torch.Tensor, route: torch.Tensor | None = None) -> torch.Tensor:
        assert route is not None  # the model passes every block its tokens' experts
        x = self._attend(x)
        h = self.ln2(x)
        if _has_no_values(h):
            return x + self._spread_evenly(h)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            chosen = route == e
            if chosen.any():  # an idle expert is not called: no gradient, not a zero one
                out[chosen] = expert(h[chosen]).to(out.dtype)  # under autocast the expert answers in bf16
        return x + out

    def _spread_evenly(self, h: torch.Tensor) -> torch.Tensor:
        """Tracing (``zbench plan --trace``): which tokens reach which expert depends on the data, which fake
        tensors do not hold, so the trace assumes the tokens spread evenly over the experts (each expert runs on
        an equal share: the peak of balanced routing; docs/methods.md)."""
        parts = h.reshape(-1, h.shape[-1]).tensor_split(len(self.experts))  # one part each, some empty if few
        return torch.cat([expert(part) for expert, part in zip(self.experts, parts)]).to(h.dtype).view_as(h)


class GPT(nn.Module):
    """``forward(idx, targets)`` returns the mean cross-entropy loss, so engines need no loss function."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList((MoEBlock if cfg.experts else Block)(cfg) for _ in range(cfg.layers))
        # Some parameters may get no gradient in a step (an expert no token reached): DDP must look for them.
        self.unused_parameters = cfg.experts > 0
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        route = expert_of(idx, self.cfg.experts) if self.cfg.experts else None
        for block in self.blocks:
            x = block(x) if route is None else block(x, route)
        logits = self.head(self.ln(x)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def build_model(name: str, *, seed: int, device: torch.device | str = "cpu") -> GPT:
    """The preset, initialised from ``seed`` on the CPU (bit-identical on every rank and every host), then moved."""
    cfg = get_config(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(cfg)
    return to_device(model, device)


def to_device(model: _M, device: torch.device | str) -> _M:
    """``model`` on ``device``: ``Module.to`` for real tensors; for fake ones (tracing), each parameter and buffer
    replaced by its moved copy, a shared (tied) one once.

    Since torch 2.14 ``Module.to`` swaps a fake parameter for its moved copy in place
    (``torch.utils.swap_tensors``), which the fake mode's own weak references to its tensors forbid
    ("Couldn't swap Embedding.weight"); replacing the parameter, as ``Module.to`` did before, keeps what
    the trace needs: the same modules holding tensors of the same shapes, tied weights still tied.
    """
    from torch._subclasses.fake_tensor import FakeTensor

    if torch.device(device) == torch.device("cpu"):
        return model
    if not any(isinstance(t, FakeTensor) for t in (*model.parameters(), *model.buffers())):
        return model.to(device)
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                if id(param) not in moved:
                    moved[id(param)] = nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)
                module._parameters[name] = moved[id(param)]  # type: ignore[assignment]
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = moved.setdefault(id(buffer), buffer.to(device))
    return model


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Recompute each block's activations in backward (non-reentrant ``torch.utils.checkpoint``), in place.

    The harness applies it before handing the model to an implementation, so every implementation trains
    the same checkpointed model. Only the block's own ``forward`` is recomputed; its module hooks (a
    stage-3 engine's gathers) fire once around the checkpointed call, not again during recomputation.
    """
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ValueError(f"activation checkpointing needs model.blocks; {type(model).__name__} has none")
    for block in blocks:
        block.forward = partial(checkpoint, type(block).forward, block, use_reentrant=False)
    return model


class DataShape(Protocol):
    """What the synthetic data depends on: a preset's ``GPTConfig`` or a user model's ``ModelInfo``."""

    @property
    def vocab(self) -> int: ...

    @property
    def seq(self) -> int: ...


def synthetic_batch(cfg: DataShape, *, seed: int, step: int, rows: int, seq: int | None = None) -> torch.Tensor:
    """The global batch of ``step``: ``rows`` sequences of ``seq + 1`` tokens, the same for every implementation.

    Tokens follow a fixed random successor table most of the time, so the loss
    really falls as the model learns (which makes time-to-target meaningful),
    with random tokens mixed in so it never reaches zero.
    """
    seq = seq or cfg.seq
    table_gen = torch.Generator().manual_seed(seed)
    successor = torch.randperm(cfg.vocab, generator=table_gen)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
    noise = torch.randint(0, cfg.vocab, (rows, seq + 1), generator=gen)
    keep = torch.rand(rows, seq + 1, generator=gen) < 0.8
    tokens = noise.clone()
    for t in range(1, seq + 1):
        tokens[:, t] = torch.where(keep[:, t], successor[tokens[:, t - 1]], noise[:, t])
    return tokens


def rank_micro_batches(
    batch: torch.Tensor, *, rank: int, world: int, grad_accum: int, device: torch.device | str = "cpu"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of a global batch (rows ``rank::world``, like DistributedSampler), split into micro-batches."""
    mine = batch[rank::world].to(device)
    return [(chunk[:, :-1], chunk[:, 1:]) for chunk in mine.chunk(grad_accum)]
