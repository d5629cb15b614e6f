"""Rebuild a plain model from a training checkpoint (``OUT/run/checkpoints/step-N``), for ``adapt export``.

A checkpoint is Accelerate's state of the training wrapper: ``model.safetensors`` holds the wrapper's
weights (keys ``model.`` + the tuned model's: the ``*ForCausalLM``, or the peft model around it),
next to the optimizer, scheduler and RNG states used to resume. To export one, the run is rebuilt as
training built it, from ``OUT/run/config.yaml``: the source decoder (unquantized), bidirectional, with
the run's mask token, LoRA attached with the run's settings; then the checkpoint's weights are
loaded into it by name and LoRA is merged. A QLoRA checkpoint's 4-bit base weights are not loaded
(they are the frozen source weights, quantized): the adapter merges into the unquantized source.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from adapt.errors import ModelLoadError

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"


@dataclass
class CheckpointModel:
    model: torch.nn.Module   # the *ForCausalLM, LoRA merged, bidirectional
    tokenizer: object
    config: object           # the run's RunConfig
    step: int
    checkpoint: Path


def find_checkpoint(path) -> Path | None:
    """``path`` itself if it is a checkpoint, the newest complete one if it is a ``checkpoints`` folder or a
    run folder (``OUT`` or ``OUT/run``) whose encoder was never exported; else None."""
    from adapt.train import STATE_FILE, checkpoint_dirs

    path = Path(path)
    if (path / STATE_FILE).is_file() and path.parent.name == "checkpoints":
        return path
    for run_dir in (path.parent if path.name == "checkpoints" else None, path, path / "run"):
        if run_dir is not None and (run_dir / "checkpoints").is_dir():
            found = checkpoint_dirs(run_dir)
            if found:
                return found[-1]
    return None


def _strip_prefix(saved_keys, wanted_keys) -> str:
    """The prefix the training wrapper put before the tuned model's keys (``model.``, or none)."""
    wanted = set(wanted_keys)
    for key in saved_keys:
        for prefix in ("model.", "module.model.", ""):
            if key.startswith(prefix) and key[len(prefix):] in wanted:
                return prefix
    raise ModelLoadError("the checkpoint's weights do not match the model its run config describes (no key in "
                         "common): were the run's model.source or tuning changed in run/config.yaml since?")


def load_checkpoint_model(checkpoint) -> CheckpointModel:
    """Rebuild the trained model of ``checkpoint`` (see the module docstring) on the CPU."""
    import yaml
    from accelerate.utils import set_seed
    from safetensors import safe_open

    from adapt.config import RunConfig
    from adapt.contrastive import DATA_FINGERPRINT
    from adapt.loading import load_decoder, setup_mask_token
    from adapt.train import STATE_FILE
    from adapt.tuning import apply_tuning

    ckpt = Path(checkpoint)
    run_dir = ckpt.parent.parent
    weights = ckpt / WEIGHTS
    if not weights.is_file():
        sharded = sorted(p.name for p in ckpt.iterdir() if p.name.startswith(("pytorch_model_fsdp", "pytorch_model")))
        hint = (f" (it holds {', '.join(sharded)}: an FSDP sharded state; gather it with "
                "`accelerate merge-weights` into a model.safetensors first)") if sharded else ""
        raise ModelLoadError(f"{ckpt} has no {WEIGHTS}{hint}")
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise ModelLoadError(f"{ckpt} is not inside an adapt run: no {config_path} to rebuild the model from")
    cfg = RunConfig.from_dict(yaml.safe_load(config_path.read_text(encoding="utf-8")))
    step = json.loads((ckpt / STATE_FILE).read_text()).get("step", 0)

    set_seed(cfg.train.seed)  # as training did: a new mask row is then initialised the same way
    model, tokenizer = load_decoder(cfg.model, None)  # unquantized, bidirectional
    new_ids = []
    if not (run_dir / DATA_FINGERPRINT).is_file():  # an MLM stage chose (maybe added) a mask token; contrastive didn't
        mask = setup_mask_token(model, tokenizer, cfg.model.mask_token)
        new_ids = [mask.id] if mask.added else []
    if cfg.tuning.method != "full":
        from dataclasses import replace

        model = apply_tuning(model, replace(cfg.tuning, method="lora", gradient_checkpointing=False),
                             new_token_ids=new_ids)
    wanted = model.state_dict()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    with safe_open(str(weights), framework="pt") as f:
        saved_keys = list(f.keys())
        prefix = _strip_prefix(saved_keys, wanted)
        loaded, skipped = {}, 0
        for key in saved_keys:
            name = key[len(prefix):] if key.startswith(prefix) else None
            if name not in wanted:
                skipped += 1  # a 4-bit base weight's quantization state, a wrapper buffer
                continue
            tensor = f.get_tensor(key)
            if tensor.shape != wanted[name].shape:
                if name in trainable:
                    raise ModelLoadError(f"{ckpt}: {name} has shape {tuple(tensor.shape)} in the checkpoint but "
                                         f"{tuple(wanted[name].shape)} in the rebuilt model")
                skipped += 1  # QLoRA: the frozen base weight, 4-bit packed
                continue
            loaded[name] = tensor
    missing = sorted(trainable - set(loaded))
    if missing:
        raise ModelLoadError(f"{ckpt} lacks {len(missing)} trained weights of the model its run describes "
                             f"(e.g. {missing[0]}); it was not written by this run's settings")
    model.load_state_dict(loaded, strict=False)
    log.info("loaded %d tensors from %s (%d skipped)", len(loaded), ckpt, skipped)
    if cfg.tuning.method != "full":
        model = model.merge_and_unload()
    model.eval()
    return CheckpointModel(model=model, tokenizer=tokenizer, config=cfg, step=int(step), checkpoint=ckpt)
