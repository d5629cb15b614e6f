"""The LM head a run trained, kept next to an encoder that holds only the backbone.

An encoder export keeps the backbone only (``AutoModel``), yet the masked-LM head MLM trained is what
a later stage (MLM again, SPLADE) or a sparse export (:mod:`adapt.export.sparse`) starts from. When the
head is not tied to the input embeddings, the runner saves it to ``OUT/run/lm_head.safetensors`` and
:func:`adapt.model.loading.load_decoder` puts it back when it loads such a folder as a causal LM.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from adapt.errors import ModelLoadError
from adapt.files import atomic_path
from adapt.config.run_folder import LM_HEAD, RUN, find_checkpoint, last_stage_dir

log = logging.getLogger(__name__)


def lm_head_name(model) -> str | None:
    """The module name of a causal LM's output layer (``lm_head``), or None when it is tied to the input
    embeddings (then the backbone alone holds it)."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embeddings is None or head.weight is embeddings.weight:
        return None
    return next(name for name, module in model.named_modules() if module is head)


def save_lm_head(model, run_folder) -> Path | None:
    """Write an untied LM head to ``run_folder/lm_head.safetensors`` (``OUT/run``): the encoder at OUT keeps only
    the backbone, and a later stage (MLM, SPLADE) or a sparse export needs the head that was trained."""
    from safetensors.torch import save_file

    name = lm_head_name(model)
    if name is None:
        return None
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.get_submodule(name).state_dict().items()}
    path = Path(run_folder) / LM_HEAD
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"module": name})
    return path


def _head_files(folder) -> list[Path]:
    """Where the head of the run in ``folder`` may be: its saved head, then its newest checkpoint's weights (a
    staged run's OUT: its last stage's), then the head a sparse export keeps beside its backbone
    (:mod:`adapt.export.sparse`'s Dense layout)."""
    folder, out = Path(folder), []
    for root in (folder, last_stage_dir(folder)):
        if root is not None:
            ckpt = find_checkpoint(root)
            out += [p for p in (root / RUN / LM_HEAD, ckpt / "model.safetensors" if ckpt else None)
                    if p is not None and p.is_file()]
    return out + ([folder / LM_HEAD] if (folder / LM_HEAD).is_file() else [])


def has_saved_lm_head(folder) -> bool:
    return bool(_head_files(folder))


def find_lm_head(folder, name: str = "lm_head") -> dict | None:
    """The tensors (``weight``, maybe ``bias``) of the LM head the run in ``folder`` trained: its
    ``run/lm_head.safetensors``, else the head in its newest checkpoint (runs made before heads were saved);
    a staged run's OUT looks in its last stage. None when there is none."""
    from safetensors import safe_open

    for path in _head_files(folder):
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
            if path.name == LM_HEAD:
                return {k: f.get_tensor(k) for k in keys}
            found = {}
            for part in ("weight", "bias"):  # model.lm_head.weight, model.base_model.model.lm_head.weight (LoRA)
                matches = [k for k in keys if k == f"{name}.{part}" or k.endswith(f".{name}.{part}")]
                if matches:
                    found[part] = f.get_tensor(min(matches, key=len))
            if "weight" in found:
                return found
    return None


def restore_lm_head(model, folder, missing_keys) -> str:
    """Put back the LM head ``folder``'s weights lack (see :func:`find_lm_head`). Returns "tied", "loaded" (the
    weights held it), "restored" or "missing" (newly initialised, with a warning)."""
    name = lm_head_name(model)
    if name is None:
        return "tied"
    if not any(key.startswith(f"{name}.") for key in missing_keys):
        return "loaded"
    tensors = find_lm_head(folder, name)
    if tensors is None:
        log.warning("%s has no LM head and no run of it saved one: the '%s' head is newly initialised (random)",
                    folder, model.config.model_type)
        return "missing"
    head = model.get_submodule(name)
    for key, value in tensors.items():
        param = getattr(head, key)
        if param is None or param.shape != value.shape:
            raise ModelLoadError(f"{folder}: the saved LM head's {key} has shape {tuple(value.shape)}, the model's "
                                 f"{None if param is None else tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(value.to(param.dtype))
    log.info("restored the trained LM head of %s", folder)
    return "restored"
