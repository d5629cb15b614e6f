"""The one training loop, on Accelerate: accumulation, warmup/decay, eval, checkpoints, exact resume.

Every stage trains here; what it trains is an objective (:mod:`adapt.objectives`), which the loop
does not look into. Launch on one process through ``adapt convert``; on several with
``accelerate launch --config_file presets/accelerate/ddp.yaml -m adapt convert ...``.

Exact resume: objectives make batch k (and its mask) a pure function of (seed, k, rank), and
checkpoints hold model, optimizer, scheduler and RNG states, so a run resumed from step N continues
exactly as the uninterrupted run would have. The model state of a LoRA/QLoRA run (a peft model) is the
weights the optimizer trains plus the training module's own state outside the tuned model (a SPLADE
term bias, its IDF buffer): the frozen base is rebuilt from the run's config, as ``adapt export`` does
(``Trainer`` registers Accelerate's save/load pre-hooks for it). Full fine-tuning saves the whole model;
a LoRA checkpoint of the whole model (written before) still loads.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from adapt.config.settings import TrainConfig
from adapt.errors import TrainingError
from adapt.files import append_jsonl, atomic_path, atomic_write_json, atomic_write_text, read_jsonl
from adapt.config.run_folder import CHECKPOINTS, METRICS, STATE_FILE, checkpoint_dirs, checkpoint_name

log = logging.getLogger(__name__)
PART = "loss/"  # a term of the training loss in the metrics log: loss/infonce, loss/keep_source, ...

WEIGHTS = "model.safetensors"  # Accelerate's file for the one module a Trainer prepares


@dataclass
class TrainResult:
    step: int
    tokens: int
    seconds: float
    last_eval: dict
    metrics_path: Path


def build_accelerator(train: TrainConfig, project_dir, gradient_accumulation_steps: int = 1):
    """The run's one Accelerator: precision, accumulation and the trackers of ``train.trackers``."""
    from accelerate import Accelerator

    return Accelerator(gradient_accumulation_steps=gradient_accumulation_steps, mixed_precision=train.mixed_precision,
                       log_with=available_trackers(train.trackers) or None, project_dir=str(project_dir))


def build_optimizer(model, train: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, no weight decay on 1-D ones (norms, biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise TrainingError("the model has no trainable parameters: check tuning.method and target_modules")
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": train.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    try:
        # The fused kernel: one pass over all parameters instead of a loop of small ops; about
        # 10x faster for the optimizer step of a 135M model on CPU (benchmarks/tools/train_throughput.py).
        return torch.optim.AdamW(groups, lr=train.lr, fused=True)
    except (RuntimeError, TypeError, ValueError):  # a dtype or device without the fused kernel
        return torch.optim.AdamW(groups, lr=train.lr)


def lr_factor(step: int, *, kind: str, warmup: int, total: int) -> float:
    """The learning-rate multiplier at ``step``: linear warmup over ``warmup`` steps, then cosine (to 0),
    linear (to 0) or constant, as transformers' ``get_scheduler`` defines them."""
    if step < warmup:
        return step / max(1, warmup)
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def build_scheduler(optimizer, train: TrainConfig):
    """Warmup then cosine, linear or constant decay over ``train.max_steps`` optimizer steps (a torch
    ``LambdaLR``: importing transformers' schedules would import peft, and with it bitsandbytes)."""
    warmup = int(train.warmup_ratio * train.max_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_factor, kind=train.scheduler, warmup=warmup, total=train.max_steps))


class Trainer:
    """The loop: ``objective`` supplies the module, the data and each micro-batch's forward and backward.

    One optimizer step is ``objective.micro_batches`` micro-batches under ``accelerator.accumulate``,
    then clipping, the optimizer and the scheduler. The loop evaluates, logs (metrics.jsonl and the
    Accelerate trackers), checkpoints, resumes, stops on a NaN loss and saves on Ctrl-C.
    """

    def __init__(self, model, objective, *, train: TrainConfig, run_dir: Path, accelerator,
                 show_progress: bool = True):
        self.objective, self.tcfg, self.accelerator = objective, train, accelerator
        self.run_dir = Path(run_dir)
        self.show_progress = show_progress
        module = objective.module(model)
        optimizer = build_optimizer(module, train)  # the model's parameters and the module's own (a SPLADE term bias)
        # Stepped by hand once per optimizer step (not prepared: Accelerate would step it per process).
        self.scheduler = build_scheduler(optimizer, train)
        self.module, self.optimizer = accelerator.prepare(module, optimizer)
        accelerator.register_for_checkpointing(self.scheduler)
        self.trained: set[int] | None = None  # ids of the parameters a checkpoint keeps (None: the whole model)
        if keeps_trained_only(model):
            self.trained = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
            accelerator.register_save_state_pre_hook(self._keep_trained)
            accelerator.register_load_state_pre_hook(self._load_trained)
        self.model = model
        self.step, self.tokens = 0, 0
        self.metrics_path = self.run_dir / METRICS
        self.last_eval: dict = {}
        self.best: dict | None = None  # with train.best_metric: {"step", "value", "state"} of the best evaluation

    # ---- checkpoints -----------------------------------------------------------------------
    def _ours(self, module) -> bool:
        """Whether ``module`` (as Accelerate lists it: wrapped by DDP or not, by version) is the one trained here."""
        unwrap = self.accelerator.unwrap_model
        return module is self.module or unwrap(module) is unwrap(self.module)

    def _trained_names(self, module) -> dict[int, list[str]]:
        """The names (tied ones included) of each trained parameter in ``module``'s state."""
        names = defaultdict(list)
        for name, param in module.named_parameters(remove_duplicate=False):
            if id(param) in self.trained:
                names[id(param)].append(name)
        return names

    def _kept_keys(self, module) -> set[str]:
        """State keys of ``module`` a LoRA checkpoint keeps: the trained parameters, and what the training module
        holds outside the tuned model (a SPLADE stage's term bias and IDF buffer)."""
        inner = next((name for name, sub in module.named_modules() if sub is self.model), "")
        outside = {key for key in module.state_dict() if inner and not key.startswith(inner + ".")}
        return outside | {name for names in self._trained_names(module).values() for name in names}

    def _keep_trained(self, models, weights, output_dir) -> None:
        """Accelerate's save pre-hook: drop the frozen weights from the module's state before it is written."""
        for module, state in zip(models, weights):
            if self._ours(module):
                keep = self._kept_keys(module)
                for key in [k for k in state if k not in keep]:
                    del state[key]

    def _load_trained(self, models, input_dir) -> None:
        """Accelerate's load pre-hook: load a checkpoint of the trained weights into the module (the frozen
        ones stay as loaded) and take the module off Accelerate's list; one of the whole model is left to it."""
        from safetensors.torch import load_file

        path = Path(input_dir) / WEIGHTS
        module = next((m for m in models if self._ours(m)), None)
        if module is None or not path.is_file():
            return
        state, kept = load_file(str(path)), self._kept_keys(module)
        if set(state) & (set(module.state_dict()) - kept):
            return  # frozen weights in it: the whole model (written before checkpoints kept the trained ones only)
        missing = [names[0] for names in self._trained_names(module).values() if not any(n in state for n in names)]
        unexpected = sorted(set(state) - kept)
        if missing or unexpected:
            what = (f"lacks {len(missing)} trained weights of this run (e.g. {missing[0]})" if missing else
                    f"holds {len(unexpected)} weights this run does not train (e.g. {unexpected[0]})")
            raise TrainingError(f"{path} {what}: it was not written by this run's settings; resume with them, or "
                                "use --overwrite")
        module.load_state_dict(state, strict=False)
        models[:] = [m for m in models if m is not module]

    def save_checkpoint(self) -> Path:
        acc = self.accelerator
        final = self.run_dir / CHECKPOINTS / checkpoint_name(self.step)
        tmp = final.with_name(final.name + ".tmp")
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp), safe_serialization=True)
        # Every process writes into tmp (its own RNG state): the rename waits for all of them.
        acc.wait_for_everyone()
        if acc.is_main_process:
            atomic_write_json(tmp / STATE_FILE, {"step": self.step, "tokens": self.tokens, "last_eval": self.last_eval})
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            for old in checkpoint_dirs(self.run_dir)[:-self.tcfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()
        return final

    def resume(self) -> bool:
        """Load the last complete checkpoint, if any; log lines written after it are dropped."""
        ckpts = checkpoint_dirs(self.run_dir)
        if ckpts:
            last = ckpts[-1]
            self.accelerator.load_state(str(last))
            state = json.loads((last / STATE_FILE).read_text())
            self.step, self.tokens, self.last_eval = state["step"], state["tokens"], state.get("last_eval", {})
        if self.accelerator.is_main_process and self.metrics_path.exists():  # also a run killed before its first checkpoint
            kept = [r for r in read_jsonl(self.metrics_path) if r.get("step", 0) <= self.step]
            atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
        if not ckpts:
            return False
        log.info("resumed from %s (step %d)", last, self.step)
        return True

    # ---- steps -----------------------------------------------------------------------------
    def evaluate(self) -> dict:
        return self.objective.evaluate(self.module, self.accelerator)

    def _track_best(self) -> bool:
        """Remember the weights of the best evaluation (``train.best_metric``); True when patience ran out."""
        name = self.tcfg.best_metric
        if not name:
            return False
        if name not in self.last_eval:
            raise TrainingError(f"train.best_metric={name!r} is not an eval metric of this run; it has "
                                f"{', '.join(sorted(self.last_eval)) or 'none'}")
        value, lower = self.last_eval[name], name.endswith("_loss")
        if self.best is None or (value < self.best["value"] if lower else value > self.best["value"]):
            trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
            state = {n: t.detach().clone() for n, t in self.accelerator.unwrap_model(self.module).model.state_dict().items()
                     if n in trainable}
            self.best = {"step": self.step, "value": value, "state": state, "stale": 0}
            return False
        self.best["stale"] += 1
        return bool(self.tcfg.patience) and self.best["stale"] >= self.tcfg.patience

    def _log(self, record: dict) -> None:
        if self.accelerator.is_main_process:
            append_jsonl(self.metrics_path, record)
        self.accelerator.log({k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))},
                             step=record["step"])

    def check_finite(self, loss: torch.Tensor, what: str) -> None:
        """Stop (on every process) with a TrainingError naming the last good checkpoint if a loss is NaN/inf."""
        acc = self.accelerator
        bad = acc.gather(torch.tensor([0.0 if torch.isfinite(loss) else 1.0], device=acc.device)).sum()
        if bad > 0:
            ckpts = checkpoint_dirs(self.run_dir)
            keep = f"the last good checkpoint is {ckpts[-1]}" if ckpts else "no checkpoint was written yet"
            raise TrainingError(
                f"loss became {float(loss)} at step {self.step + 1} ({what}); training stopped, "
                f"{keep}. Lower train.lr, or use train.mixed_precision=bf16 instead of fp16, then --resume.")

    def train_step(self) -> tuple[str, list[float], int]:
        """One optimizer step (without the scheduler): returns (what trained, micro-batch losses, tokens seen)."""
        acc, t = self.accelerator, self.tcfg
        losses, tokens, label = [], 0, ""
        self.step_parts = {}
        for _ in range(self.objective.micro_batches):
            with acc.accumulate(self.module):
                out = self.objective.step(self.module, acc, self.step)
                self.check_finite(out.loss, out.label)  # before the update: a NaN never reaches the weights
                if acc.sync_gradients and t.max_grad_norm > 0:
                    acc.clip_grad_norm_(self.module.parameters(), t.max_grad_norm)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            losses.append(float(out.loss))
            tokens, label = tokens + out.tokens, out.label
            for name, value in out.parts.items():
                self.step_parts.setdefault(name, []).append(float(value))
        return label, losses, tokens

    def fit(self, *, resume: bool = False) -> TrainResult:
        from tqdm.auto import tqdm

        acc, t = self.accelerator, self.tcfg
        if resume:
            self.resume()
        if acc.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        if t.trackers:
            acc.init_trackers("adapt", config={"lr": t.lr, "max_steps": t.max_steps, "batch_size": t.batch_size,
                                               "kind": getattr(self.objective, "kind", "")})
        self.objective.start(self.step, acc)
        bar = tqdm(total=t.max_steps, initial=self.step, desc="train", disable=not (self.show_progress and acc.is_main_process),
                   dynamic_ncols=True)
        self.module.train()
        start, window_t, window_tok, losses, parts = time.perf_counter(), time.perf_counter(), 0, [], {}
        try:
            while self.step < t.max_steps:
                label, step_losses, step_tokens = self.train_step()
                losses += step_losses
                for name, values in self.step_parts.items():
                    parts.setdefault(name, []).extend(values)
                self.tokens += step_tokens
                window_tok += step_tokens
                self.scheduler.step()
                self.step += 1
                bar.update(1)
                if self.step % t.log_every == 0 or self.step == t.max_steps:
                    now = time.perf_counter()
                    rate = window_tok / max(now - window_t, 1e-9)
                    record = {"step": self.step, "objective": label, "loss": float(np.mean(losses)),
                              "loss_name": getattr(self.objective, "loss_name", "loss"),
                              **{f"{PART}{name}": float(np.mean(v)) for name, v in parts.items()},
                              "lr": self.scheduler.get_last_lr()[0], "tokens": self.tokens, "tokens_per_s": rate,
                              "elapsed_s": now - start}
                    self._log(record)
                    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{rate:.0f}", obj=label)
                    window_t, window_tok, losses, parts = now, 0, [], {}
                stop = False
                if (t.eval_every and self.step % t.eval_every == 0) or self.step == t.max_steps:
                    self.last_eval = self.evaluate()
                    self._log({"step": self.step, **self.last_eval})
                    stop = self._track_best()
                if (t.save_every and self.step % t.save_every == 0) or self.step == t.max_steps or stop:
                    self.save_checkpoint()
                if stop:
                    log.info("no better %s for %d evaluations: stopped at step %d", t.best_metric, t.patience, self.step)
                    break
        except KeyboardInterrupt:
            bar.close()
            saved = self.save_checkpoint() if self.step > 0 else None
            where = f"checkpoint saved at {saved}" if saved else "nothing to save yet"
            raise TrainingError(f"interrupted at step {self.step}; {where}. Run the same command with --resume to continue.") from None
        finally:
            bar.close()
        if t.trackers:
            acc.end_training()
        if self.best is not None:  # the weights of the best evaluation, as the run's result
            acc.unwrap_model(self.module).model.load_state_dict(self.best["state"], strict=False)
            self.last_eval = {**self.last_eval, "best_step": self.best["step"], "best_value": self.best["value"]}
        return TrainResult(self.step, self.tokens, time.perf_counter() - start, self.last_eval, self.metrics_path)


def keeps_trained_only(model) -> bool:
    """Whether the checkpoints of training ``model`` keep only its trained weights: a LoRA/QLoRA (peft) model."""
    return hasattr(model, "peft_config")


def available_trackers(names: list[str]) -> list[str]:
    import importlib.util

    out = []
    for name in names:
        module = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(name, name)
        if importlib.util.find_spec(module) is not None:
            out.append(name)
        else:
            log.warning("tracker %r is not installed; skipped (the jsonl metrics log is always written)", name)
    return out


def plot_metrics(metrics_path: Path, out_png: Path) -> Path | None:
    """The loss curve of a run's log as a PNG (see :func:`loss_figure`); None when nothing was logged."""
    fig = loss_figure(read_jsonl(metrics_path))
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    with atomic_path(out_png) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return out_png


def loss_figure(records: list[dict]):
    """The training loss per log step, labelled with what it is (the objective's ``loss_name``), held-out
    losses as markers, and, when the loss has several terms (InfoNCE plus keep_source's, ranking plus
    FLOPS), each term in a panel of its own below. None when no finite loss was logged."""
    train = [(r["step"], r["loss"]) for r in records if "loss" in r and math.isfinite(r["loss"])]
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.get("loss_name") for r in records if r.get("loss_name")]
    what = " then ".join(dict.fromkeys(names)) or "loss"  # a chain of objectives names each (mixtures: one name)
    parts = sorted({k[len(PART):] for r in records for k in r if k.startswith(PART)})
    fig, axes = plt.subplots(2 if parts else 1, 1, figsize=(7, 6.5 if parts else 4), sharex=True, squeeze=False)
    ax = axes[0][0]
    ax.plot(*zip(*train), label=f"train: {what}")
    eval_keys = sorted({k for r in records for k in r if k.startswith("eval/") and k.endswith("_loss")})
    for key in eval_keys:
        pts = [(r["step"], r[key]) for r in records if key in r]
        ax.plot(*zip(*pts), "o--", label=f"held out: {key[5:]}")
    ax.set_ylabel(what if len(what) <= 30 else "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    if parts:
        below = axes[1][0]
        for name in parts:
            pts = [(r["step"], r[PART + name]) for r in records if PART + name in r and math.isfinite(r[PART + name])]
            below.plot(*zip(*pts), label=name)
        below.set_ylabel("terms of the training loss")
        below.grid(alpha=0.3)
        below.legend()
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    return fig
