"""LLM2Vec's MNTP trainer, timed: runs in LLM2Vec's own virtual environment (transformers 4.43-4.44).

Started by ``benchmarks/tools/train_throughput.py`` as a long-lived subprocess so its steps can be interleaved
with the other configurations of the same run. It reproduces ``experiments/run_mntp.py`` of
McGill-NLP/llm2vec: ``LlamaBiForMNTP.from_pretrained`` (bidirectional Llama), ``initialize_peft``
(LoRA on the inner model, q/k/v/o/gate/up/down), ``DataCollatorForLanguageModeling`` (80-10-10) and
``MNTPTrainer`` (a ``Trainer`` that keeps every column), with ``TrainingArguments(bf16=..., use_cpu=...)``.

Protocol (stdout lines starting with ``@@``; everything else is ignored by the parent):
  -> ``@@READY {json}`` once loaded
  <- ``run N``   -> ``@@RESULT {"seconds": [...N step times...]}``
  <- ``quit``
Only the standard library, numpy, torch, transformers, peft and llm2vec are imported.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path


def _say(tag: str, obj) -> None:
    sys.stdout.write(f"@@{tag} {json.dumps(obj)}\n")
    sys.stdout.flush()


def _legacy_tokenizer(folder: Path):
    """The folder's tokenizer for tokenizers < 0.20 (transformers 5 writes merges as pairs, not strings)."""
    from transformers import PreTrainedTokenizerFast

    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    merges = data.get("model", {}).get("merges")
    if merges and isinstance(merges[0], list):
        data["model"]["merges"] = [" ".join(pair) for pair in merges]
    tmp = Path(tempfile.mkdtemp()) / "tokenizer.json"
    tmp.write_text(json.dumps(data), encoding="utf-8")
    specials = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    keys = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token")
    return PreTrainedTokenizerFast(tokenizer_file=str(tmp), **{k: specials[k] for k in keys if specials.get(k)})


def _llama_config(folder: Path):
    """config.json written by transformers 5 (``rope_parameters``) read as a transformers 4.44 LlamaConfig."""
    from transformers import LlamaConfig

    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    rope = raw.pop("rope_parameters", None) or {}
    if "rope_theta" in rope:
        raw["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default":
        raw["rope_scaling"] = rope
    raw.pop("dtype", None)
    return LlamaConfig(**raw)


def main() -> None:
    spec = json.loads(sys.argv[1])
    import numpy as np
    import torch
    import torch.distributed.tensor  # noqa: F401 - peft 0.21 reads torch.distributed.tensor, which 4.44 never imports
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import DataCollatorForLanguageModeling, PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from llm2vec.models import LlamaBiForMNTP

    torch.set_num_threads(spec["threads"])
    device = spec["device"]
    folder = Path(spec["model_dir"])
    tokenizer = _legacy_tokenizer(folder)
    config = _llama_config(folder)
    if config.model_type != "llama":
        raise SystemExit(f"this worker runs LLM2Vec's Llama class only, not {config.model_type!r}")
    model = LlamaBiForMNTP.from_pretrained(str(folder), config=config, attn_implementation=spec["attn"],
                                           torch_dtype=torch.float32)
    # run_mntp.py's initialize_peft: LoRA on the inner LlamaBiModel
    lora = LoraConfig(r=spec["lora_r"], lora_alpha=2 * spec["lora_r"], lora_dropout=0.05, bias="none", task_type=None,
                      target_modules=["q_proj", "v_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model.set_model_for_peft(get_peft_model(model.get_model_for_peft(), lora))
    if device != "cpu":
        model.to(device)

    blocks = np.load(spec["blocks"])  # (N, seq_len) token ids packed by the parent: the same data
    special = set(tokenizer.all_special_ids)
    dataset = [{"input_ids": row.tolist(), "special_tokens_mask": [int(t in special) for t in row.tolist()]}
               for row in blocks]
    collator = DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm_probability=spec["mask_ratio"])

    class MNTPTrainer(Trainer):  # as in run_mntp.py
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.label_names = ["labels"]

        def _remove_unused_columns(self, dataset, description=None):
            return dataset

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.stamps = []

        def on_step_end(self, args, state, control, **kwargs):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            self.stamps.append((time.perf_counter(), time.process_time()))

    autocast_seen = set()
    model.get_input_embeddings().register_forward_pre_hook(
        lambda module, args: autocast_seen.add(torch.is_autocast_enabled(device.split(":")[0])))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    _say("READY", {"transformers": transformers.__version__, "torch": torch.__version__,
                   "trainable_params": trainable, "total_params": sum(p.numel() for p in model.parameters())})
    out_dir = tempfile.mkdtemp()
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        n = int(cmd[1])
        timer = StepTimer()
        args = TrainingArguments(
            output_dir=out_dir, per_device_train_batch_size=spec["batch"], max_steps=n + 1, learning_rate=5e-5,
            weight_decay=0.01, lr_scheduler_type="constant", max_grad_norm=1.0, bf16=spec["bf16"],
            use_cpu=device == "cpu", report_to="none", save_strategy="no", logging_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0, seed=spec["seed"], dataloader_pin_memory=False)
        trainer = MNTPTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=[timer])
        trainer.remove_callback(PrinterCallback)  # keep stdout for the protocol
        trainer.train()
        del trainer
        # one step more than asked: its interval would include the Trainer's setup, so it is not reported
        # Accelerate wrapped the model's forward in autocast in the first round and marked it prepared;
        # later Trainers keep that wrapper. The probe below checks every forward ran as asked.
        steps = np.diff(np.array(timer.stamps), axis=0)  # (n, 2): wall and CPU seconds per step
        _say("RESULT", {"seconds": steps[:, 0].tolist(), "cpu_seconds": steps[:, 1].tolist(),
                        "autocast": sorted(autocast_seen)})
        autocast_seen.clear()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
