"""An :class:`adapt.inference.encoder.Encoder` as mteb 2.x's encoder protocol: ``mteb.evaluate(MTEBAdapter(enc), tasks)``."""
from __future__ import annotations

import numpy as np
import torch


class MTEBAdapter:
    """An :class:`Encoder` as mteb 2.x's encoder protocol: ``mteb.evaluate(MTEBAdapter(enc), tasks)``.

    Query/document prompts follow mteb's prompt-name resolution over the encoder's prompts.
    """

    def __init__(self, encoder, *, batch_size: int = 32):
        self.encoder, self.batch_size = encoder, batch_size
        self.model_prompts = encoder.prompts or None

    @property
    def mteb_model_meta(self):
        from mteb.models import ModelMeta
        return ModelMeta.create_empty(overwrites=dict(
            name=f"adapt/{self.encoder.name}", revision=self.encoder.fingerprint, embed_dim=self.encoder.dim,
            max_tokens=self.encoder.max_length, framework=["PyTorch"], similarity_fn_name="cosine"))

    def encode(self, inputs, *, task_metadata, hf_split, hf_subset, prompt_type=None, **kwargs) -> np.ndarray:
        from mteb.models.abs_encoder import get_prompt_name
        texts = [text for batch in inputs for text in batch["text"]]
        name = get_prompt_name(self.model_prompts, task_metadata, prompt_type) if self.model_prompts else None
        # no name resolved: the encoder's default prompt (a sink prompt, export.sink_prompt), if it has one
        return self.encoder.encode(texts, batch_size=kwargs.get("batch_size", self.batch_size), prompt_name=name)

    def similarity(self, a, b):
        return _unit(a) @ _unit(b).T

    def similarity_pairwise(self, a, b):
        return (_unit(a) * _unit(b)).sum(-1)


def _unit(x) -> torch.Tensor:
    x = x.float() if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return torch.nn.functional.normalize(x, dim=-1)
