"""Masked-LM continued pretraining: MLM, MNTP, CLM and their mixtures and phases, on packed text.

Data: the corpus of ``data.sources`` tokenized once into a packed token store on disk
(:func:`adapt.data.token_store.build_token_store`, built by the main process, read by all). Batch k and its mask
are pure functions of (seed, k, rank), so a resumed run continues exactly as the uninterrupted one.
Loss: :class:`adapt.objectives.masking.LabeledPositionsLM` (the LM head only at labelled rows).
"""
from __future__ import annotations

import numpy as np
import torch

from adapt.config.settings import RunConfig
from adapt.data.batches import batch_iterator
from adapt.data.token_store import build_token_store, resolve_data_sources, resolve_sources
from adapt.errors import ConfigError
from adapt.config.run_folder import TOKEN_STORE
from adapt.model.loading import setup_mask_token
from adapt.objectives import ObjectiveBase, StageContext, StepOutput
from adapt.objectives.masking import IGNORE_INDEX, LabeledPositionsLM, mask_batch
from adapt.config.schedule import ObjectiveSchedule

KINDS = {"mlm": {}, "mntp": {"objective": {"schedule": "mntp"}}}

TRAIN_STREAM, EVAL_STREAM = 0, 1


def mask_generator(seed: int, stream: int, index: int, rank: int = 0) -> torch.Generator:
    """Masks are a pure function of (seed, stream, index, rank): stream 0 trains, stream 1 evaluates."""
    state = np.random.SeedSequence([seed, stream, index, rank]).generate_state(1)[0]
    return torch.Generator().manual_seed(int(state))


class MaskedLM(ObjectiveBase):
    """The ``objective`` section's schedule on the packed corpus; ``train.grad_accum`` micro-batches a step."""

    uses_lm_head = True
    loss_name = "cross-entropy"  # of the labelled positions (MLM, MNTP or CLM: the log's `objective`)

    def __init__(self, cfg: RunConfig):
        self.cfg, self.kind = cfg, cfg.kind
        self.schedule = ObjectiveSchedule(cfg.objective.schedule, seed=cfg.train.seed)
        self.micro_batches = cfg.train.grad_accum
        self.mask = self.store = None

    def read_data(self):
        if not self.cfg.data.sources:
            raise ConfigError("no training text: pass --data PATH (text, jsonl, parquet, folder) or a preset that "
                              "names it")
        resolve_sources(resolve_data_sources(self.cfg.data.sources))  # a missing file: said before the model loads
        return None

    def configure_model(self, model, tokenizer) -> list[int]:
        """Choose (maybe add) the mask token; seeded by the runner, so a reload adds the same row."""
        self.mask = setup_mask_token(model, tokenizer, self.cfg.model.mask_token)
        self.special_ids = sorted({i for i in (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id,
                                               tokenizer.unk_token_id) if i is not None})
        self.vocab_size = len(tokenizer)  # random replacements never use padding rows
        return [self.mask.id] if self.mask.added else []

    def prepare(self, ctx: StageContext) -> None:
        d, acc = self.cfg.data, ctx.accelerator
        with acc.main_process_first():
            self.store = build_token_store(resolve_data_sources(d.sources), ctx.tokenizer, ctx.run_dir / TOKEN_STORE,
                                           seq_len=d.seq_len, text_field=d.text_field, eval_fraction=d.eval_fraction,
                                           max_tokens=d.max_tokens, show_progress=ctx.show_progress and acc.is_main_process)

    def module(self, model) -> torch.nn.Module:
        return LabeledPositionsLM(model)

    def start(self, step: int, accelerator) -> None:
        t = self.cfg.train
        self._micro = step * t.grad_accum
        self._batches = batch_iterator(self.store.train, t.batch_size, seed=t.seed, start_step=self._micro,
                                       rank=accelerator.process_index, world_size=accelerator.num_processes)
        self._tokens_per_micro = t.batch_size * self.store.seq_len * accelerator.num_processes

    def batch(self, blocks: np.ndarray, objective: str, generator: torch.Generator, device=None):
        """(inputs, labels) of ``objective`` for packed ``blocks`` (B, T), masked with ``generator``."""
        o = self.cfg.objective
        ids = torch.from_numpy(np.asarray(blocks).astype(np.int64))
        inputs, labels = mask_batch(ids, objective, mask_token_id=self.mask.id, vocab_size=self.vocab_size,
                                    special_ids=self.special_ids, ratio=o.mask_ratio, replacement=o.replacement,
                                    generator=generator)
        return (inputs, labels) if device is None else (inputs.to(device), labels.to(device))

    def step(self, module, accelerator, step: int) -> StepOutput:
        t = self.cfg.train
        objective = self.schedule.objective_at(step, t.max_steps)
        inputs, labels = self.batch(next(self._batches), objective,
                                    mask_generator(t.seed, TRAIN_STREAM, self._micro, accelerator.process_index),
                                    accelerator.device)
        self._micro += 1
        loss = module(input_ids=inputs, labels=labels, causal=objective == "clm")["loss"]
        accelerator.backward(loss)
        return StepOutput(loss.detach(), self._tokens_per_micro, objective)

    @torch.no_grad()
    def evaluate(self, module, accelerator) -> dict:
        """Loss and accuracy on the first ``eval_batches`` held-out batches, per objective of the schedule.

        Masks are drawn per global batch (the same on every process), and each process runs its slice of
        the rows, so the gathered figures do not depend on the number of processes.
        """
        t, acc = self.cfg.train, accelerator
        rank, world = acc.process_index, acc.num_processes
        blocks = self.store.eval[: t.batch_size * t.eval_batches]
        module.eval()
        out = {}
        for objective in sorted(self.schedule.objectives):
            sums = torch.zeros(3, dtype=torch.float64)  # loss x labels, labels, correct
            for start in range(0, len(blocks), t.batch_size):
                inputs, labels = self.batch(blocks[start:start + t.batch_size], objective,
                                            mask_generator(t.seed, EVAL_STREAM, start))
                rows = np.array_split(np.arange(len(inputs)), world)[rank]
                if not len(rows):  # every process runs every batch (FSDP gathers weights in forward)
                    rows, labels = np.arange(1), torch.full_like(labels, IGNORE_INDEX)
                res = module(input_ids=inputs[rows].to(acc.device), labels=labels[rows].to(acc.device),
                             causal=objective == "clm")
                k = float(res["n_labels"])
                sums += torch.tensor([float(res["loss"]) * k, k, float(res["n_correct"])], dtype=torch.float64)
            total = acc.gather_for_metrics(sums.to(acc.device).unsqueeze(0)).sum(0)
            n = max(float(total[1]), 1.0)
            out[f"eval/{objective}_loss"] = float(total[0]) / n
            out[f"eval/{objective}_acc"] = float(total[2]) / n
        module.train()
        return out

    def summary(self) -> dict:
        m = self.mask
        return {"mask_token": {"token": m.token, "id": m.id, "policy": m.policy, "added": m.added},
                "objective": self.cfg.objective.schedule, "mask_ratio": self.cfg.objective.mask_ratio,
                "corpus_tokens": int(self.store.num_tokens)}


OBJECTIVE = MaskedLM
