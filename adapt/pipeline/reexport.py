"""Rebuild a trained model from a run's checkpoint, and re-export any run or encoder (``adapt export``).

A checkpoint (``OUT/run/checkpoints/step-N``) is Accelerate's state of the training module:
``model.safetensors`` holds its weights (keys ``model.`` + the tuned model's: the ``*ForCausalLM``, or
the peft model around it), next to the optimizer, scheduler and RNG states used to resume. Under
LoRA/QLoRA it holds the trained weights only (adapters, new token rows, a SPLADE term bias:
:mod:`adapt.training.loop`); older ones hold the whole model. To export one, the run is rebuilt as the stage
runner built it, from ``OUT/run/config.yaml``: the source decoder (unquantized), bidirectional,
adjusted by the run's objective (its seeded mask token), LoRA attached with the run's settings; then
the checkpoint's weights are loaded into it by name and LoRA is merged. An older QLoRA checkpoint's
4-bit base weights are not loaded (they are the frozen source weights, quantized): the adapter merges
into the unquantized source.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from adapt.config import run_folder
from adapt.data.token_store import resolve_data_sources, resolve_sources
from adapt.export import kinds
from adapt.export.backends import TORCH
from adapt.export.dim_order import fitted_order, stage_texts
from adapt.errors import ConfigError, ModelLoadError
from adapt.export.dense import MANIFEST, export_encoder
from adapt.export.kinds import SPARSE
from adapt.files import read_json
from adapt.objectives import build_objective
from adapt.pipeline.stage import load_model, ordered_dims
from adapt.export.sparse import export_sparse
from adapt.model.tuning import apply_tuning

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
PEFT_TRAINED = (".lora_A.", ".lora_B.", ".trainable_tokens_delta.", ".modules_to_save.")  # in peft's weight names


@dataclass
class CheckpointModel:
    model: torch.nn.Module   # the *ForCausalLM, LoRA merged, bidirectional
    tokenizer: object
    config: object           # the run's RunConfig
    step: int
    checkpoint: Path
    matryoshka_dims: list[int]  # sizes the run trained for truncation ([] for none)
    term_bias: torch.Tensor | None = None  # a splade stage's trained per-term bias (adapt.model.splade.SparseLM)
    query_idf: torch.Tensor | None = None  # a splade stage's inference-free queries' IDF weights


def _strip_prefix(saved_keys, wanted_keys) -> str:
    """The prefix the training module put before the tuned model's keys (``model.``, or none)."""
    wanted = set(wanted_keys)
    for key in saved_keys:
        for prefix in ("model.", "module.model.", ""):
            if key.startswith(prefix) and key[len(prefix):] in wanted:
                return prefix
    raise ModelLoadError("the checkpoint's weights do not match the model its run config describes (no key in "
                         "common): were the run's model.source or tuning changed in run/config.yaml since?")


def load_checkpoint_model(checkpoint) -> CheckpointModel:
    """Rebuild the trained model of ``checkpoint`` (see the module docstring) on the CPU."""
    from accelerate.utils import set_seed
    from safetensors import safe_open

    ckpt = Path(checkpoint)
    run_dir = ckpt.parent.parent
    weights = ckpt / WEIGHTS
    if not weights.is_file():
        sharded = sorted(p.name for p in ckpt.iterdir() if p.name.startswith(("pytorch_model_fsdp", "pytorch_model")))
        hint = (f" (it holds {', '.join(sharded)}: an FSDP sharded state; gather it with "
                "`accelerate merge-weights` into a model.safetensors first)") if sharded else ""
        raise ModelLoadError(f"{ckpt} has no {WEIGHTS}{hint}")
    if not (run_dir / run_folder.CONFIG).is_file():
        raise ModelLoadError(f"{ckpt} is not inside an adapt run: no {run_dir / run_folder.CONFIG} to rebuild the model from")
    cfg = run_folder.read_run_config(run_dir)
    step = json.loads((ckpt / run_folder.STATE_FILE).read_text()).get("step", 0)

    set_seed(cfg.train.seed)  # as the runner did: a new mask row is then initialised the same way
    objective = build_objective(cfg)
    model, tokenizer, new_ids = load_model(cfg, objective, quantized=False)
    if cfg.tuning.method != "full":
        model = apply_tuning(model, replace(cfg.tuning, method="lora", gradient_checkpointing=False),
                             new_token_ids=new_ids)
    wanted = model.state_dict()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    with safe_open(str(weights), framework="pt") as f:
        saved_keys = list(f.keys())
        prefix = _strip_prefix(saved_keys, wanted)
        bias_key = next((k for k in ("term_bias", "module.term_bias") if k in saved_keys), None)
        term_bias = None if bias_key is None else f.get_tensor(bias_key).float()
        idf_key = next((k for k in ("query_idf", "module.query_idf") if k in saved_keys), None)
        query_idf = None if idf_key is None else f.get_tensor(idf_key).float()
        loaded, skipped = {}, 0
        for key in saved_keys:
            name = key[len(prefix):] if key.startswith(prefix) else None
            if name not in wanted:
                if any(part in key for part in PEFT_TRAINED):
                    raise ModelLoadError(f"{ckpt}: {key} has no place in the model its run config describes: were "
                                         "the run's tuning settings (target_modules) changed in run/config.yaml since?")
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
    return CheckpointModel(model=model, tokenizer=tokenizer, config=cfg, step=int(step), checkpoint=ckpt,
                           matryoshka_dims=objective.matryoshka_dims(), term_bias=term_bias,
                           query_idf=query_idf)


def _model_folder(source: Path) -> Path:
    """The transformers model folder inside ``source`` (itself, or a ``model/`` in it)."""
    for candidate in (source, source / "model"):
        if (candidate / "config.json").is_file():
            return candidate
    if (source / "adapter_config.json").is_file():
        raise ModelLoadError(f"{source} holds a LoRA adapter, not a model: merge it into its base and save the "
                             "merged model (adapt.model.tuning merge) before exporting it")
    raise ModelLoadError(f"{source} is not a model folder: no config.json in it or in {source / 'model'}")


def export_from_path(source, out_dir, *, pooling: str | None = None, normalize: bool | None = None,
                     max_seq_length: int | None = None, prompts: dict[str, str] | None = None, dtype=None,
                     card: dict | None = None, backend: str = TORCH, quantize: str | None = None,
                     kind: str | None = None, top_k: int | None = None, order_dims: str | None = None,
                     data: list[str] | None = None) -> Path:
    """``adapt export SOURCE -o DIR``: re-export a converted run folder, an exported encoder or a checkpoint.

    ``kind`` (:mod:`adapt.export.kinds`) "sparse": a SPLADE encoder of the causal LM with the head its run trained
    (:mod:`adapt.export.sparse`; ``top_k`` keeps each vector's k largest weights); "dense": an embedding
    encoder; None: as SOURCE was exported (a checkpoint: as its stage exports). A folder is re-exported by its
    kind's ``reexport``.

    ``backend`` a graph backend of :mod:`adapt.export.backends` (``quantize`` None or "int8"): the encoder is exported to a
    scratch folder, its graph added and checked there (:func:`adapt.export.graphs.add_backend`), and
    only then moved to ``out_dir``; a refused graph leaves ``out_dir`` as it was.

    ``SOURCE`` is a folder with ``config.json`` + safetensors (a converted/exported encoder), or a
    training checkpoint ``OUT/run/checkpoints/step-N`` (or ``OUT/run/checkpoints``: the newest; also
    ``OUT`` of a run that died before its export), rebuilt by :func:`load_checkpoint_model`. Settings left
    as None are taken from the source's previous export (``adapt_export.json``) or, for a checkpoint,
    from the run's ``export`` section; else mean pooling, no normalization, 512 tokens, no prompts.
    The source must already be bidirectional (``is_causal: false``).

    ``order_dims`` "pca": dimensions in principal order (:mod:`adapt.export.dim_order`), fitted on the documents of
    ``data`` (for a checkpoint, by default on its run's training data); "none": as pooled; None: as SOURCE
    was exported (a checkpoint: as its run's ``export.order_dims`` says).
    """
    kind = _checked_kind(kind, top_k=top_k, pooling=pooling, normalize=normalize, order_dims=order_dims, data=data)
    if backend not in (None, TORCH):
        if "backend" not in (kinds.get(kind) if kind else kinds.of_folder(source)).options:
            raise ConfigError("ONNX/OpenVINO graphs are written for dense encoders only: export the sparse encoder "
                              "with the torch backend")
        return _export_with_backend(source, out_dir, backend, quantize, pooling=pooling, normalize=normalize,
                                    max_seq_length=max_seq_length, prompts=prompts, dtype=dtype, card=card,
                                    order_dims=order_dims, data=data)
    source = Path(source)
    if not source.is_dir():
        raise ModelLoadError(f"{source} is not a folder")
    if not (source / "config.json").is_file():
        ckpt = run_folder.find_checkpoint(source)
        if ckpt is not None:
            return _export_checkpoint(ckpt, out_dir, pooling=pooling, normalize=normalize,
                                      max_seq_length=max_seq_length, prompts=prompts, dtype=dtype, card=card,
                                      kind=kind, top_k=top_k, order_dims=order_dims, data=data)
    if order_dims == "pca" and not data:  # a checkpoint (above) fits on its run's data; a folder has none
        raise ConfigError("--order-dims pca fits the axes on text: pass --data PATH (the text the encoder was trained "
                          "on, or text like what it will embed)")
    model_dir = _model_folder(source)
    target = kinds.get(kind) if kind else kinds.of_manifest(read_json(model_dir / MANIFEST))
    if order_dims is not None and "order_dims" not in target.options:
        raise ConfigError(f"{model_dir} is a sparse encoder: --order-dims orders a dense vector's dimensions; add "
                          "--kind dense for a dense encoder of it")
    options = dict(pooling=pooling, normalize=normalize, order_dims=order_dims, data=data, top_k=top_k)
    return target.run("reexport", model_dir, out_dir, max_seq_length=max_seq_length, prompts=prompts, dtype=dtype,
                      card=card, **{k: v for k, v in options.items() if k in target.options})


def _checked_kind(kind, *, top_k, pooling, normalize, order_dims, data) -> str | None:
    """The export kind asked (``--top-k`` implies sparse; None: as the source was exported), its options checked
    before anything loads."""
    if order_dims not in (None, "none", "pca"):
        raise ConfigError(f"unknown dimension order {order_dims!r}: pca or none")
    if data and order_dims != "pca":
        raise ConfigError("--data is the text that --order-dims pca fits the axes on: add --order-dims pca")
    if data:  # a missing file: said before any model loads
        resolve_sources(resolve_data_sources([data] if isinstance(data, str) else list(data)))
    wanted = SPARSE if top_k is not None else kind
    if order_dims is not None and wanted is not None and "order_dims" not in kinds.get(wanted).options:
        raise ConfigError("--order-dims orders a dense vector's dimensions; a sparse vector's are vocabulary terms")
    if kind is not None and "top_k" not in kinds.get(kind).options and top_k is not None:
        raise ConfigError(f"--top-k prunes sparse vectors: it does not apply to --kind {kind}")
    kind = wanted
    if kind is not None and (pooling or normalize) and "pooling" not in kinds.get(kind).options:
        raise ConfigError("a sparse encoder pools the LM head's logits (max of log1p(relu)): --pooling and "
                          "--normalize apply to dense exports")
    return kind


def _export_with_backend(source, out_dir, backend, quantize, **settings) -> Path:
    import shutil
    import tempfile

    from adapt.export.graphs import add_backend
    from adapt.export.dense import move_into

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.{backend}.", dir=out_dir.parent))
    try:
        built = export_from_path(source, scratch / "built", **settings)
        add_backend(built, backend, quantize, name=out_dir.name)  # the card names the folder, not the scratch
        move_into(built, out_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out_dir


def _export_checkpoint(ckpt: Path, out_dir, *, pooling, normalize, max_seq_length, prompts, dtype, card, kind=None,
                       top_k=None, order_dims=None, data=None) -> Path:
    """Export a training checkpoint: the run rebuilt from its config, LoRA merged; settings default to the run's."""
    loaded = load_checkpoint_model(ckpt)
    cfg, run_dir = loaded.config, ckpt.parent.parent
    summary = read_json(run_dir / run_folder.SUMMARY)
    facts = {"source": cfg.model.source, "checkpoint": f"{ckpt.name} (step {loaded.step} of {cfg.train.max_steps})",
             "objective": cfg.objective.schedule, "tuning": cfg.tuning.method, "recipe": cfg.to_dict()}
    if summary.get("final_eval"):
        facts["final_eval (end of the run)"] = summary["final_eval"]
    exp, objective = cfg.export, build_objective(cfg)
    if prompts is None:  # as the run exported them: the objective's own (contrastive.query_prompt), then export's
        prompts = {**objective.export_prompts(), **(exp.prompts or {})} or None
    if (kind or objective.export_kind) == SPARSE:
        return export_sparse(loaded.model, loaded.tokenizer, out_dir, term_bias=loaded.term_bias,
                             query_idf=loaded.query_idf,
                             top_k=top_k if top_k is not None else
                             cfg.splade.top_k, max_seq_length=max_seq_length or exp.max_seq_length,
                             prompts=prompts,
                             dtype=dtype if dtype is not None else exp.dtype, card={**facts, **(card or {})},
                             source=cfg.model.source)
    settings = dict(pooling=pooling or exp.pooling, max_seq_length=max_seq_length or exp.max_seq_length,
                    prompts=prompts, sink_prompt=exp.sink_prompt)
    if order_dims is None:  # as the run exports (its texts, its pooling)
        fitted = replace(cfg, export=replace(exp, pooling=settings["pooling"], max_seq_length=settings["max_seq_length"]))
        rotation, order = ordered_dims(fitted, loaded.model, loaded.tokenizer, settings["prompts"])
    else:
        rotation, order = fitted_order(order_dims, data, loaded.model, loaded.tokenizer, settings,
                                     runs_texts=lambda: stage_texts(cfg))
    return export_encoder(loaded.model, loaded.tokenizer, out_dir, **settings,
                          normalize=exp.normalize if normalize is None else normalize,
                          dtype=dtype if dtype is not None else exp.dtype, card={**facts, **(card or {})},
                          source=cfg.model.source, matryoshka_dims=loaded.matryoshka_dims, rotation=rotation,
                          order=order)


