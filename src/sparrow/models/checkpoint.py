"""Load a state dict (torchtune parameter names) into a Sparrow model; Hugging Face directories are read by
:mod:`sparrow.models.hf`."""

from __future__ import annotations

import torch
from torchtune.modules import TransformerDecoder



def load_model_state(model: TransformerDecoder, state: dict[str, torch.Tensor]) -> None:
    """``load_state_dict`` that tolerates only missing attention-backend parameters (e.g. an indexer)."""
    own = model.state_dict()
    bad_shapes = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
                  for k, v in state.items() if k in own and own[k].shape != v.shape]
    if bad_shapes:
        raise ValueError("checkpoint does not fit the model: " + "; ".join(bad_shapes[:5]))
    missing = [k for k in own if k not in state and ".backend." not in k]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.load_state_dict(state, strict=False)
