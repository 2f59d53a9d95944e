"""Model presets by name: GPT shapes from ``tiny`` to ``gpt-70b``, with exact parameter and FLOP counts.

Plain data, no torch: the suite parser, ``zbench plan`` and the formulas read
these without building anything. ``zbench.cases.models`` builds the module from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GPTConfig:
    layers: int
    d_model: int
    heads: int
    vocab: int
    seq: int
    mlp_ratio: int = 4
    tie_embeddings: bool = False
    """The output head reuses the token embedding's weight (GPT-2, Llama-style): one tensor, two uses."""
    ffn: int | None = None
    """The MLP's hidden width, when it is not ``mlp_ratio x d_model``."""
    experts: int = 0
    """MLP experts per block, one module each, a token routed to one of them by its id (``zbench.cases.models``:
    ``expert_of``); 0: a dense MLP."""

    def __post_init__(self) -> None:
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by heads {self.heads}")
        if self.experts == 1 or self.experts < 0:
            raise ValueError(f"experts must be 0 (a dense MLP) or at least 2, not {self.experts}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def ffn_hidden(self) -> int:
        return self.ffn or self.mlp_ratio * self.d_model

    @property
    def embedding_parameters(self) -> int:
        return (self.vocab + self.seq) * self.d_model

    @property
    def mlp_parameters(self) -> int:
        """Parameters of one MLP (an expert's, with experts)."""
        d, h = self.d_model, self.ffn_hidden
        return d * h + h + h * d + d

    @property
    def block_parameters(self) -> int:
        """Parameters of one transformer block (two layer norms, attention, the MLP or every expert's)."""
        d = self.d_model
        attention = d * 3 * d + 3 * d + d * d + d
        return 2 * (2 * d) + attention + max(self.experts, 1) * self.mlp_parameters

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """Parameters of each block, in order (``zbench.protocol.ModelShape``)."""
        return (self.block_parameters,) * self.layers

    @property
    def largest_unit_parameters(self) -> int:
        """The biggest unit a stage-3 engine gathers at once: a block, the embeddings or the head."""
        return max(self.block_parameters, self.embedding_parameters, self.d_model * self.vocab)

    @property
    def parameter_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shape of each distinct parameter of ``GPT(self)``, in ``parameters()`` order (a tied head is the
        embedding: it counts once, there)."""
        d, h = self.d_model, self.ffn_hidden
        mlp = ((h, d), (h,), (d, h), (d,))  # fc, out (each expert's, in order)
        attention = ((3 * d, d), (3 * d,), (d, d), (d,))  # qkv, proj
        block = ((d,), (d,), *attention, (d,), (d,), *mlp * max(self.experts, 1))  # ln1, attention, ln2, MLP
        head = () if self.tie_embeddings else ((self.vocab, d),)
        return ((self.vocab, d), (self.seq, d), *block * self.layers, (d,), (d,), *head)

    @property
    def parameter_sizes(self) -> tuple[int, ...]:
        """Elements of each distinct parameter, in ``parameters()`` order."""
        return tuple(math.prod(shape) for shape in self.parameter_shapes)

    @property
    def num_parameters(self) -> int:
        """Exact count of the parameters ``GPT(self)`` holds."""
        return (
            self.embedding_parameters
            + self.layers * self.block_parameters
            + 2 * self.d_model
            + (0 if self.tie_embeddings else self.d_model * self.vocab)
        )

    def flops_per_token(self, seq: int | None = None) -> float:
        """Training FLOPs per token at sequence length ``seq`` (default: the full context): 6·(Ψ − embeddings)
        + attention, 6·layers·heads·head_dim·seq (docs/methods.md); with experts, a token goes through one of
        them, so the others' parameters do not count."""
        head = self.d_model * self.vocab if self.tie_embeddings else 0  # a tied head still multiplies
        idle_experts = self.layers * max(self.experts - 1, 0) * self.mlp_parameters
        return 6 * (
            self.num_parameters - self.embedding_parameters + head - idle_experts
        ) + 6 * self.layers * self.heads * self.head_dim * (seq or self.seq)


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(layers=2, d_model=64, heads=2, vocab=256, seq=32),
    "tiny-tied": GPTConfig(layers=2, d_model=64, heads=2, vocab=256, seq=32, tie_embeddings=True),
    "small": GPTConfig(layers=4, d_model=256, heads=4, vocab=1024, seq=128),
    "small-tied": GPTConfig(layers=4, d_model=256, heads=4, vocab=1024, seq=128, tie_embeddings=True),
    # tiny with four experts per block (one module each): the last takes token id 0 alone, so it is often idle on
    # a rank, or on all (zbench.cases.models.expert_of)
    "moe-tiny": GPTConfig(layers=2, d_model=64, heads=2, vocab=256, seq=32, experts=4),
    # ~41M parameters: AdamW state of 330 MB, big enough that offloading it shows in a CPU rank's resident memory
    "medium": GPTConfig(layers=4, d_model=768, heads=12, vocab=8192, seq=128),
    "gpt-125m": GPTConfig(layers=12, d_model=768, heads=12, vocab=50304, seq=2048),
    "gpt-350m": GPTConfig(layers=24, d_model=1024, heads=16, vocab=50304, seq=2048),
    "gpt-760m": GPTConfig(layers=24, d_model=1536, heads=16, vocab=50304, seq=2048),
    "gpt-1.3b": GPTConfig(layers=24, d_model=2048, heads=32, vocab=50304, seq=2048),
    "gpt-2.7b": GPTConfig(layers=32, d_model=2560, heads=32, vocab=50304, seq=2048),
    "gpt-6.7b": GPTConfig(layers=32, d_model=4096, heads=32, vocab=50304, seq=2048),
    "gpt-13b": GPTConfig(layers=40, d_model=5120, heads=40, vocab=50304, seq=2048),
    "gpt-30b": GPTConfig(layers=48, d_model=7168, heads=56, vocab=50304, seq=2048),
    "gpt-70b": GPTConfig(layers=87, d_model=8192, heads=64, vocab=50304, seq=2048),
    # Llama 3.1 8B's size in this GPT: its layers, width, heads, vocabulary and context, and its parameter
    # count (8.07B vs 8.03B: a GELU MLP of 18,432 holds what SwiGLU's three 14,336-wide matrices hold, full
    # attention heads where Llama shares K/V, learned positions). For comparing with published Llama figures.
    "llama3-8b-size": GPTConfig(layers=32, d_model=4096, heads=32, vocab=128256, seq=8192, ffn=18432),
}


def preset(name: str) -> GPTConfig | None:
    """A preset's configuration, cut to fewer blocks when the name says so (``zbench.depth``); None when
    ``name`` is not a preset."""
    from zbench.depth import split_depth

    base, blocks = split_depth(name)
    if base not in PRESETS:
        return None
    cfg = PRESETS[base]
    return cfg if blocks is None else replace(cfg, layers=blocks)


def get_config(name: str) -> GPTConfig:
    cfg = preset(name)
    if cfg is None:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(PRESETS)}")
    return cfg
