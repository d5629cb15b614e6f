"""Two-process check of adapt.contrastive, run by tests/objectives/test_contrastive.py (not collected by pytest):

    OMP_NUM_THREADS=1 ACCELERATE_USE_CPU=true python -m torch.distributed.run --nproc_per_node 2 \
        tests/objectives/ddp_contrastive_check.py RESULT_DIR

1. ``all_gather_rows`` on rows of different counts per process: the gathered tensor, and the gradient
   each process receives (the sum over processes of the loss gradients at its own rows).
2. One real contrastive ``Trainer`` step (DDP over gloo, supervised pairs with a hard negative each,
   documents gathered across processes, gradient caching in chunks of 3 texts): the DDP-averaged
   parameter gradient equals the gradient of the plain full-batch loss computed in one process.
3. The same with Matryoshka sizes (weighted, given out of order): the full-batch loss is then the
   weighted sum of InfoNCE over the re-normalized prefixes.
4. The same with ``keep_source`` (a frozen source, as under full fine-tuning): each process adds the weight times
   1 - linear CKA of its own texts' vectors with the source's, so the full-batch loss adds the mean over processes.
Rank 0 writes RESULT_DIR/result.json; any failed check exits non-zero.
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate import Accelerator  # noqa: E402

from adapt.config.settings import RunConfig  # noqa: E402
from adapt.model.embedding import Embedder, tokenize  # noqa: E402
from adapt.objectives.contrastive import Contrastive  # noqa: E402
from adapt.objectives.infonce import all_gather_rows, info_nce, linear_cka  # noqa: E402
from adapt.data.pairs import Pair  # noqa: E402
from adapt.training.loop import Trainer  # noqa: E402
from tests.tiny import tiny_decoder, tiny_tokenizer  # noqa: E402

torch.set_num_threads(1)
out = Path(sys.argv[1])
acc = Accelerator(cpu=True)
rank, world = acc.process_index, acc.num_processes
assert world == 2, f"run with 2 processes, not {world}"
result = {}

# ---- 1. gather with gradient, rows of different counts per process -----------------------------
rows = [3, 2]
gen = torch.Generator().manual_seed(0)
xs = [torch.randn(n, 4, generator=gen) for n in rows]  # every rank knows every rank's rows
weights = [torch.randn(sum(rows), 4, generator=gen) for _ in range(world)]
x = xs[rank].clone().requires_grad_()
gathered, offset = all_gather_rows(x)
assert offset == sum(rows[:rank]), offset
assert torch.equal(gathered.detach(), torch.cat(xs)), "gathered rows differ"
(gathered * weights[rank]).sum().backward()
expected = sum(w[offset:offset + rows[rank]] for w in weights)
torch.testing.assert_close(x.grad, expected)
result["gather_ok"] = True

# ---- 2. a DDP contrastive step equals the full-batch gradient (3. with Matryoshka sizes too) -----
tok = tiny_tokenizer()
topics = ["fox", "river", "engine", "violin", "garden", "planet", "market", "winter"]
pairs = [Pair(f"what is the {t}?", f"the {t} is here, a {t} indeed", (f"nothing about {topics[i - 1]} here",))
         for i, t in enumerate(topics)]


def ddp_step(prefix: str, **contrastive) -> None:
    """One DDP step of a fresh model against the same global batch embedded in one process, one graph."""
    cfg = RunConfig.from_dict({"contrastive": {"loss": "pairs", "mini_batch": 3, "hard_negatives": 1,
                                               "temperature": 0.1, "query_prompt": "q: ", **contrastive},
                               "train": {"batch_size": 4, "max_steps": 1, "lr": 1e-3, "max_grad_norm": 0.0,
                                         "warmup_ratio": 0.0}, "export": {"pooling": "mean"}})
    model = tiny_decoder("llama", vocab_size=len(tok), seed=3)
    reference = tiny_decoder("llama", vocab_size=len(tok), seed=3)
    model.lm_head.requires_grad_(False)
    objective = Contrastive(cfg)
    objective.configure_model(model, tok)
    objective.train_set, objective.eval_set = pairs, []
    source = None
    if contrastive.get("keep_source"):  # a frozen source of other weights: the term then has a gradient
        source = Embedder(tiny_decoder("llama", vocab_size=len(tok), seed=5).requires_grad_(False), "mean").eval()
        objective.frozen_source = source
    trainer = Trainer(model, objective, train=cfg.train, run_dir=out / f"{prefix}rank{rank}", accelerator=acc,
                      show_progress=False)
    objective.start(0, acc)
    captured = {}
    trainer.optimizer.step = lambda *a, **k: captured.update(
        {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
    _, losses, _ = trainer.train_step()

    # the same global batch in one process, one graph, no gathering, no caching
    global_batch = [pairs[i] for i in objective._batches._permutation(0)[:8]]
    embed = Embedder(reference, "mean").train()
    queries = embed(**tokenize(tok, ["q: " + p.query for p in global_batch], 128))
    docs = embed(**tokenize(tok, [p.positive for p in global_batch] + [p.negatives[0] for p in global_batch], 128))
    sizes = objective.sizes or [(queries.shape[1], 1.0)]
    ref_loss = sum(w * info_nce(queries[:, :d], docs[:, :d], torch.arange(8), 0.1)[0] for d, w in sizes)
    if source is not None:  # each process's term over its own 4 pairs' texts (queries, positives, negatives)
        for r in range(world):
            mine = global_batch[4 * r:4 * r + 4]
            texts = (["q: " + p.query for p in mine] + [p.positive for p in mine] + [p.negatives[0] for p in mine])
            batch = tokenize(tok, texts, 128)
            with torch.no_grad():
                target = source(**batch)
            ref_loss = ref_loss + contrastive["keep_source"] * (1 - linear_cka(embed(**batch), target)) / world
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert captured.keys() == ref_grads.keys(), (sorted(captured), sorted(ref_grads))
    diff = max(float((captured[n] - ref_grads[n]).abs().max()) for n in ref_grads)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    mean_loss = float(acc.gather(torch.tensor([losses[0]])).mean())
    result.update({f"{prefix}grad_max_abs_diff": diff, f"{prefix}grad_max_abs": scale, f"{prefix}loss": mean_loss,
                   f"{prefix}ref_loss": float(ref_loss.detach())})
    assert diff <= 1e-4 * scale + 1e-6, f"DDP gradient differs from the full-batch gradient by {diff} (scale {scale})"
    assert abs(mean_loss - float(ref_loss)) < 1e-4, (mean_loss, float(ref_loss))


ddp_step("")
ddp_step("matryoshka_", matryoshka_dims=[8, "full", 16], matryoshka_weights=[0.25, 1.0, 0.5])
ddp_step("keep_", keep_source=2.0)
if rank == 0:
    (out / "result.json").write_text(json.dumps(result))
acc.wait_for_everyone()
acc.end_training()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
