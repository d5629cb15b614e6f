"""The stage runner: the one setup and teardown of every training stage, whatever its objective.

    config -> objective (adapt.objectives, by ``kind``) -> its data read -> one Accelerator -> OUT prepared
    -> seed -> load (bidirectional) -> objective adjusts the model -> probe -> objective's data built
    -> tuning -> the loop (adapt.training.loop) -> adapter saved and merged -> [dimensions ordered] -> export -> probe of the saved
    folder -> summary

The result ``OUT`` is a transformers model folder and a sentence-transformers folder at once; the
run's own files sit under ``OUT/run/`` (:mod:`adapt.config.run_folder`). :func:`adapt.pipeline.convert.convert` and
:mod:`adapt.pipeline.chain` call :func:`run_stage`; :mod:`adapt.pipeline.reexport` rebuilds a run's model the same way.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from adapt.config import run_folder
from adapt.model.bidirectional import assert_bidirectional
from adapt.config.settings import RunConfig
from adapt.errors import DataError, NotBidirectionalError
from adapt.export.dense import export_encoder
from adapt.model.lm_head import save_lm_head
from adapt.files import atomic_write_json
from adapt.model.loading import load_decoder
from adapt.objectives import StageContext, build_objective
from adapt.export.sparse import SPARSE, export_sparse
from adapt.training.loop import Trainer, build_accelerator, plot_metrics
from adapt.model.tuning import apply_tuning, save_adapter_and_merge, trainable_parameters

log = logging.getLogger(__name__)


@dataclass
class StageResult:
    out: Path
    config: RunConfig
    summary: dict


@contextlib.contextmanager
def quiet_transformers(quiet: bool = True):
    """Silence transformers' load reports (an encoder export has no LM head: "newly initialized" is expected)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    if quiet:
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def load_model(cfg: RunConfig, objective, *, quantized: bool = True):
    """The decoder of ``cfg`` loaded bidirectional (quantized for QLoRA unless ``quantized=False``) and
    adjusted by ``objective``; returns (model, tokenizer, token ids the objective added)."""
    with quiet_transformers(not objective.uses_lm_head):
        model, tokenizer = load_decoder(cfg.model, cfg.tuning if quantized else None)
    return model, tokenizer, objective.configure_model(model, tokenizer)


def probe_saved(out: Path):
    """Reload ``out`` through plain transformers (as a user would) and prove it is still bidirectional."""
    from transformers import AutoModel

    config = json.loads((out / "config.json").read_text())
    if config.get("is_causal", True) is not False:
        raise NotBidirectionalError(f"{out}/config.json does not say is_causal: false")
    with quiet_transformers():  # a sparse export's root holds the LM head, which AutoModel leaves aside
        model = AutoModel.from_pretrained(str(out))  # as a user loads it: no arguments (export pins attention)
    return assert_bidirectional(model, where=f"{out} reloaded with transformers")


def ordered_dims(cfg: RunConfig, model, tokenizer, prompts: dict | None = None):
    """(rotation, what the manifest records) for ``export.order_dims: pca`` (:mod:`adapt.export.dim_order`), fitted
    on the stage's training text with its document prompt; (None, None) for ``none``."""
    if cfg.export.order_dims != "pca":
        return None, None
    from adapt.export.dim_order import fit_order, stage_texts

    return fit_order(model, tokenizer, stage_texts(cfg), pooling=cfg.export.pooling,
                     max_length=cfg.export.max_seq_length, prompt=(prompts or {}).get("document", ""),
                     sink_prompt=cfg.export.sink_prompt)


def _check_fingerprint(run_dir: Path, fingerprint: dict | None, resume: bool) -> None:
    saved = run_dir / run_folder.DATA_FINGERPRINT
    if fingerprint is None:
        return
    if resume and saved.is_file() and json.loads(saved.read_text()) != fingerprint:
        raise DataError(f"--resume: the training data differ from the data {run_dir.parent} was trained on (its "
                        "examples changed); resume with the same data, or use --overwrite")
    atomic_write_json(saved, fingerprint)


def run_stage(cfg: RunConfig, out, *, resume: bool = False, overwrite: bool = False, show_progress: bool = True,
              accelerator=None) -> StageResult:
    """Train ``cfg`` (one stage: its ``kind`` names the objective) into ``out``; see the module docstring."""
    from accelerate.utils import set_seed

    t0 = time.perf_counter()
    out = Path(out).expanduser().resolve()
    run_dir = run_folder.run_dir(out)
    objective = build_objective(cfg)
    fingerprint = objective.read_data()  # bad data fails before anything is written
    acc = accelerator or build_accelerator(cfg.train, run_dir, objective.micro_batches)
    objective.check_launch(acc)
    if acc.is_main_process:
        run_folder.prepare_out(out, {"": cfg}, resume=resume, overwrite=overwrite)
        _check_fingerprint(run_dir, fingerprint, resume)
    acc.wait_for_everyone()

    set_seed(cfg.train.seed)  # a new mask-token row and LoRA init are random: make them repeatable
    model, tokenizer, new_token_ids = load_model(cfg, objective)
    probe_before = assert_bidirectional(model, where=f"before training ({cfg.kind})")
    objective.prepare(StageContext(model, tokenizer, run_dir, acc, show_progress))
    model = apply_tuning(model, cfg.tuning, new_token_ids=new_token_ids)
    if not objective.uses_lm_head:
        head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
        if head is not None and head.weight is not embeddings.weight:
            head.requires_grad_(False)  # never run: an encoder objective trains the backbone only
    trainable, total = trainable_parameters(model)
    trainer = Trainer(model, objective, train=cfg.train, run_dir=run_dir, accelerator=acc,
                      show_progress=show_progress)
    result = trainer.fit(resume=resume)

    summary = {}
    if acc.is_main_process:
        trained = acc.unwrap_model(trainer.module).model

        def load_base():  # QLoRA merges into an unquantized copy of the base, adjusted as in training
            return load_model(cfg, objective, quantized=False)[0]

        merged = save_adapter_and_merge(trained, cfg.tuning, run_dir, load_base)
        merged.eval()
        tokenizer.padding_side = "right"
        plot = plot_metrics(result.metrics_path, run_dir / run_folder.LOSS_PLOT)
        summary = {"source": cfg.model.source, "model_type": merged.config.model_type, "kind": cfg.kind,
                   **objective.summary(), "tuning": cfg.tuning.method, "trainable_parameters": trainable,
                   "total_parameters": total, "processes": acc.num_processes, "steps": result.step,
                   "tokens": result.tokens, "train_seconds": round(result.seconds, 1), "final_eval": result.last_eval,
                   "probe_before": probe_before.to_dict(),
                   "loss_plot": f"{run_folder.RUN}/{run_folder.LOSS_PLOT}" if plot else None}
        save_lm_head(merged, run_dir)  # the export keeps the backbone only: a later stage needs the trained head
        prompts = {**objective.export_prompts(), **(cfg.export.prompts or {})}
        common = dict(max_seq_length=cfg.export.max_seq_length, prompts=prompts or None, dtype=cfg.export.dtype,
                      card={**summary, "recipe": cfg.to_dict()}, source=cfg.model.source)
        if objective.export_kind == SPARSE:
            sparse = acc.unwrap_model(trainer.module)
            export_sparse(merged, tokenizer, out, top_k=cfg.splade.top_k, term_bias=getattr(sparse, "term_bias", None),
                          query_idf=getattr(sparse, "query_idf", None), **common)
        else:
            rotation, order = ordered_dims(cfg, merged, tokenizer, prompts)
            export_encoder(merged, tokenizer, out, pooling=cfg.export.pooling, normalize=cfg.export.normalize,
                           matryoshka_dims=objective.matryoshka_dims(), rotation=rotation, order=order,
                           sink_prompt=cfg.export.sink_prompt, **common)
        summary["probe_after"] = probe_saved(out).to_dict()
        summary["wall_seconds"] = round(time.perf_counter() - t0, 1)
        atomic_write_json(run_dir / run_folder.SUMMARY, summary)
    acc.wait_for_everyone()
    return StageResult(out, cfg, summary)
