"""``adapt convert``: any causal decoder becomes a verified bidirectional encoder.

load -> bidirectional (probe) -> mask token -> data store -> tuning -> train -> merge -> save and
export -> probe again on the saved folder. The result OUT is a transformers model folder and a
sentence-transformers folder at once; the run's own files sit under ``OUT/run/``::

    OUT/config.json, model.safetensors, tokenizer*, modules.json, 1_Pooling/, README.md
    OUT/run/config.yaml       resolved configuration (what was actually run)
    OUT/run/metrics.jsonl     training and eval log;  OUT/run/loss.png  its plot
    OUT/run/summary.json      probe results, mask token, figures
    OUT/run/checkpoints/      step-N/ (resume points), OUT/run/adapter/ (LoRA), OUT/run/data/ (token store)
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from adapt.config import RunConfig, build_config
from adapt.errors import ConfigError, NotBidirectionalError, OutputExistsError
from adapt.io_utils import atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)

RUN = "run"


@dataclass
class ConvertResult:
    out: Path
    config: RunConfig
    summary: dict


def resolve_data_sources(sources: list[str]) -> list[str]:
    """``gensim:NAME`` names a file of gensim's test data (real text that installs from PyPI)."""
    out = []
    for s in sources:
        if s.startswith("gensim:"):
            try:
                from gensim.test.utils import datapath
            except ImportError:
                raise ConfigError(f"{s}: pip install gensim==4.4.0 to use gensim's test data") from None
            s = datapath(s.split(":", 1)[1])
        out.append(s)
    return out


def _prepare_out(out: Path, cfg: RunConfig, *, resume: bool, overwrite: bool) -> None:
    saved = out / RUN / "config.yaml"
    if out.exists() and any(out.iterdir()):
        if overwrite:
            shutil.rmtree(out)
        elif resume and saved.exists():
            old = RunConfig.from_dict(yaml.safe_load(saved.read_text()))
            a, b = old.to_dict(), cfg.to_dict()
            a["train"].pop("max_steps"), b["train"].pop("max_steps")
            if a != b:
                diff = [f"{s}.{k}" for s in a for k in (a[s] if isinstance(a[s], dict) else {})
                        if isinstance(a[s], dict) and a[s].get(k) != b.get(s, {}).get(k)]
                raise ConfigError(f"--resume: the settings differ from the run in {out} ({', '.join(diff) or 'description'}); "
                                  "resume with the same command (only train.max_steps may change), or use --overwrite")
        elif resume:
            raise OutputExistsError(f"{out} is not empty and holds no adapt run to resume; choose another -o")
        else:
            what = "another adapt run" if saved.exists() else "files"
            raise OutputExistsError(f"{out} already holds {what}: pass --resume to continue it, --overwrite to "
                                    "replace it, or choose another -o")
    (out / RUN).mkdir(parents=True, exist_ok=True)


def convert(source: str | None, out: str | Path, *, preset: str | None = None, overrides: list[str] = (),
            data: list[str] | None = None, objective: str | None = None, tuning: str | None = None,
            max_steps: int | None = None, resume: bool = False, overwrite: bool = False,
            show_progress: bool = True, accelerator=None) -> ConvertResult:
    """Convert ``source`` into a bidirectional encoder at ``out``; see the module docstring for the layout."""
    from accelerate import Accelerator

    t0 = time.perf_counter()
    cfg = build_config(preset, list(overrides), model__source=source, data__sources=list(data) if data else None,
                       objective__schedule=objective, tuning__method=tuning, train__max_steps=max_steps)
    if not cfg.data.sources:
        raise ConfigError("no training text: pass --data PATH (text, jsonl, parquet, folder) or a preset that names it")
    out = Path(out).expanduser().resolve()
    acc = accelerator or Accelerator(gradient_accumulation_steps=cfg.train.grad_accum,
                                     mixed_precision=cfg.train.mixed_precision, project_dir=str(out / RUN))
    if acc.is_main_process:
        _prepare_out(out, cfg, resume=resume, overwrite=overwrite)
        atomic_write_text(out / RUN / "config.yaml", cfg.to_yaml())
    acc.wait_for_everyone()
    run_dir = out / RUN

    from adapt.bidirectional import assert_bidirectional
    from adapt.data import build_token_store
    from adapt.loading import load_decoder, setup_mask_token
    from adapt.train import Trainer, plot_metrics
    from adapt.tuning import apply_tuning, save_adapter_and_merge, trainable_parameters

    from accelerate.utils import set_seed

    set_seed(cfg.train.seed)  # the new mask-token row and LoRA init are random: make them repeatable
    model, tokenizer = load_decoder(cfg.model, cfg.tuning)
    mask = setup_mask_token(model, tokenizer, cfg.model.mask_token)
    probe_before = assert_bidirectional(model, where="before training")
    special_ids = sorted({i for i in (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id,
                                      tokenizer.unk_token_id) if i is not None})
    with acc.main_process_first():
        store = build_token_store(resolve_data_sources(cfg.data.sources), tokenizer, run_dir / "data",
                                  seq_len=cfg.data.seq_len, text_field=cfg.data.text_field,
                                  eval_fraction=cfg.data.eval_fraction, max_tokens=cfg.data.max_tokens,
                                  show_progress=show_progress and acc.is_main_process)
    model = apply_tuning(model, cfg.tuning, new_token_ids=[mask.id] if mask.added else [])
    trainable, total = trainable_parameters(model)
    trainer = Trainer(model, store=store, cfg=cfg, run_dir=run_dir, mask_token_id=mask.id, special_ids=special_ids,
                      vocab_size=len(tokenizer), accelerator=acc, show_progress=show_progress)
    result = trainer.fit(resume=resume)

    summary = {}
    if acc.is_main_process:
        model = acc.unwrap_model(trainer.wrapper).model
        def load_base():  # QLoRA merges into an unquantized copy of the base, mask row included
            base, base_tokenizer = load_decoder(cfg.model, None)
            setup_mask_token(base, base_tokenizer, cfg.model.mask_token)
            return base

        merged = save_adapter_and_merge(model, cfg.tuning, run_dir, load_base)
        tokenizer.padding_side = "right"
        plot = plot_metrics(result.metrics_path, run_dir / "loss.png")
        summary = {
            "source": cfg.model.source, "model_type": merged.config.model_type,
            "mask_token": {"token": mask.token, "id": mask.id, "policy": mask.policy, "added": mask.added},
            "objective": cfg.objective.schedule, "mask_ratio": cfg.objective.mask_ratio, "tuning": cfg.tuning.method,
            "trainable_parameters": trainable, "total_parameters": total, "steps": result.step,
            "tokens": result.tokens, "train_seconds": round(result.seconds, 1), "final_eval": result.last_eval,
            "corpus_tokens": int(store.num_tokens), "probe_before": probe_before.to_dict(),
            "loss_plot": str(plot) if plot else None,
        }
        from adapt.export import export_encoder

        export_encoder(merged, tokenizer, out, pooling=cfg.export.pooling, normalize=cfg.export.normalize,
                       max_seq_length=cfg.export.max_seq_length, prompts=cfg.export.prompts or None,
                       dtype=cfg.export.dtype, card={**summary, "recipe": cfg.to_dict()}, source=cfg.model.source)
        summary["probe_after"] = _probe_saved(out).to_dict()
        summary["wall_seconds"] = round(time.perf_counter() - t0, 1)
        atomic_write_json(run_dir / "summary.json", summary)
    acc.wait_for_everyone()
    return ConvertResult(out, cfg, summary)


def _probe_saved(out: Path):
    """Reload OUT through plain transformers (as a user would) and prove it is still bidirectional."""
    from transformers import AutoModel

    from adapt.bidirectional import assert_bidirectional

    config = json.loads((out / "config.json").read_text())
    if config.get("is_causal", True) is not False:
        raise NotBidirectionalError(f"{out}/config.json does not say is_causal: false")
    model = AutoModel.from_pretrained(str(out))  # as a user loads it: no arguments (export pins attention)
    return assert_bidirectional(model, where=f"{out} reloaded with transformers")
