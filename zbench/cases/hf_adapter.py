"""A transformers causal LM behind the harness's model contract (docs/methods.md#models-users-bring).

``forward(idx, targets)`` returns the mean next-token loss from the logits and
the harness's already shifted targets (the model's own ``labels`` path would
shift them again); ``blocks`` names the decoder layers, the units of activation
checkpointing and of the stage-3 engines; ``vocab_size`` and ``max_seq_len``
say what data it takes. Imported only when such a model is built: it needs
transformers (the ``hf`` extra).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch import nn


class HFCausalLM(nn.Module):
    """A transformers causal LM: token ids in, the mean loss out."""

    def __init__(self, model: transformers.PreTrainedModel, *, max_seq_len: int) -> None:
        super().__init__()
        self.model = model
        self.vocab_size: int = int(model.config.vocab_size)
        self.max_seq_len = max_seq_len

    @property
    def blocks(self) -> nn.ModuleList:
        """The decoder layers (a view, not a second registration: ``model.model.layers`` holds them)."""
        layers = self.model.get_submodule("model.layers")
        assert isinstance(layers, nn.ModuleList)
        return layers

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=idx, use_cache=False).logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def build(config: dict[str, Any], *, max_seq_len: int) -> HFCausalLM:
    """The model of ``config`` (a transformers config's fields, ``model_type`` among them), on the CPU in fp32,
    initialised by transformers from torch's CPU generator."""
    hf_config = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa", dtype=torch.float32)
    return HFCausalLM(model, max_seq_len=max_seq_len)
