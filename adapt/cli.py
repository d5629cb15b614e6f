"""The ``adapt`` command line: a thin click layer over the library.

    adapt convert MODEL -o OUT [--preset NAME] [--data PATH ...] [--objective mlm|mntp|clm] [--tuning full|lora|qlora]
    adapt presets [NAME] [--path]   list presets, or show one (or its file; accelerate/NAME: an Accelerate config)
    adapt probe MODEL               is this model bidirectional?
    adapt export SOURCE -o DIR      write an embedding encoder with another pooling or dtype [--backend onnx|openvino]
    adapt embed ENCODER [TEXT ...]  embed text [-o DIR/: resumable shards; torchrun: several processes]
    adapt finetune ENCODER --data TRAIN -o DIR / adapt classify DIR --input FILE
    adapt bench MODEL [MODEL ...]   retrieval, classification and similarity, side by side [torchrun: several processes]

Several processes: ``accelerate launch --config_file "$(adapt presets --path accelerate/ddp)" -m adapt convert ...``.
"""
from __future__ import annotations

import errno
import functools
import json
import logging
import os
import sys
from pathlib import Path

import click

from adapt import __version__
from adapt.export import backends, kinds

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _no_bitsandbytes() -> None:
    """Commands that never quantize keep bitsandbytes out of the process (ADAPT_ALLOW_BNB=1 lets it in);
    `adapt convert` decides once its configuration is resolved."""
    from adapt.model.quantization import hide_bitsandbytes

    hide_bitsandbytes()


def _friendly(fn):
    """Print AdaptError messages (bad input) without a traceback; exit code 2."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from adapt.errors import AdaptError

        try:
            return fn(*args, **kwargs)
        except AdaptError as e:
            click.secho(f"error: {e}", fg="red", err=True)
            sys.exit(2)
        except Exception as e:
            if not _disk_full(e):
                raise
            click.secho(f"error: the disk is full ({e}). Free some space (a checkpoint of full fine-tuning holds the "
                        "weights and twice their size in optimizer state; an export writes the weights twice "
                        "before it moves them in), then run the same command again: `adapt convert` with "
                        "--resume goes on from its last checkpoint. What was being written was in a temporary "
                        "folder and is not where an encoder is loaded from.", fg="red", err=True)
            sys.exit(2)
    return wrapper


def _disk_full(e: BaseException) -> bool:
    """An OSError ENOSPC, or a library's own error carrying its text (safetensors raises SafetensorError)."""
    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("-v", "--verbose", is_flag=True, help="Log more.")
@click.version_option(__version__, "--version", prog_name="adapt", message="%(prog)s %(version)s")
def main(verbose):
    """adapt: turn any causal decoder LLM into a bidirectional encoder (contrastive stages by default; masked
    ones - MLM, MNTP, CLM mixtures - as options, which have not helped in our CPU-budget measurements: see the
    README), export it for sentence-transformers / transformers / mteb, embed text, fine-tune classifiers and
    benchmark them (frozen and fine-tuned) against the source."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


@main.command()
@click.argument("model", required=False)
@click.option("-o", "--out", required=True, type=click.Path(file_okay=False), help="Output folder (encoder + run/).")
@click.option("--preset", help="Recipe from presets/ (see `adapt presets`) or a YAML path.")
@click.option("--data", multiple=True, help="Training text: .txt, .jsonl, .parquet, a folder, hf:NAME, gensim:FILE. Repeatable.")
@click.option("--objective", help="A masked stage first: mlm, mntp or clm (mixtures and phases: in a preset or --set "
              "objective.schedule=...). Measured on SmolLM2-135M at 15 CPU minutes it did not help: fine-tuned "
              "classifiers 0.06 (dev) to 0.09 (test) below the demo's recipe, embeddings below the source "
              "(README, 'Which recipe').")
@click.option("--tuning", type=click.Choice(["full", "lora", "qlora"]), help="Full fine-tuning, LoRA or QLoRA.")
@click.option("--max-steps", type=int, help="Optimizer steps (every stage's, with --stages).")
@click.option("--stages", help="Chain stages, e.g. mlm,simcse, mntp,contrastive or mlm,splade (kinds: mlm, mntp, "
              "simcse, contrastive, crops, splade: a sparse encoder); each starts from the one before. Per stage: "
              "--set KIND.section.key=value.")
@click.option("--pairs", type=click.Path(dir_okay=False), help="JSON lines of {query, positive, negatives?} for a "
              "`contrastive` or `splade` stage.")
@click.option("--resume", is_flag=True, help="Continue the run in OUT from its last checkpoint (finished stages are kept).")
@click.option("--overwrite", is_flag=True, help="Replace whatever OUT holds.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override any setting, e.g. train.lr=1e-4.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@_friendly
def convert(model, out, preset, data, objective, tuning, max_steps, stages, pairs, resume, overwrite, overrides, quiet):
    """Convert MODEL (a folder, hub id, .gguf file or py:PACKAGE) into a bidirectional encoder at OUT.

    With --stages (or a preset naming stages, e.g. llm2vec: MNTP then SimCSE) the stages run in turn
    under OUT/stages/ and the last one's encoder is published at OUT."""
    from adapt.pipeline.convert import convert as run

    result = run(model, out, preset=preset, overrides=list(overrides), data=list(data) or None, objective=objective,
                 tuning=tuning, max_steps=max_steps, stages=stages, pairs=pairs, resume=resume, overwrite=overwrite,
                 show_progress=not quiet, hide_bnb=True)
    s = result.summary
    if not s:  # not the main process
        return
    if result.stages:
        click.echo(f"converted {s['source']} through {len(s['stages'])} stages -> {result.out}")
        for name in s["stages"]:
            st = s["per_stage"].get(name) or {}
            evals = ", ".join(f"{k} {v:.4f}" for k, v in sorted((st.get("final_eval") or {}).items()))
            click.echo(f"  {name}: {st.get('steps')} steps{', ' + evals if evals else ''}")
    else:
        click.echo(f"converted {s['source']} ({s['model_type']}) -> {result.out}")
        click.echo(f"  steps {s['steps']}, tokens {s['tokens']:,}, {s['train_seconds']} s training, {s['wall_seconds']} s in all")
        for k, v in sorted(s["final_eval"].items()):
            click.echo(f"  {k} = {v:.4f}")
        if s.get("loss_plot"):
            click.echo(f"  loss curve: {result.out / s['loss_plot']}")
    click.echo(f"  probe after reload: first-token change {s['probe_after']['unpadded']:.3g} (bidirectional)")
    from adapt.config.run_folder import CHECKPOINTS

    kept = [p for p in Path(result.out).rglob(CHECKPOINTS) if p.is_dir()]
    size = sum(f.stat().st_size for d in kept for f in d.rglob("*") if f.is_file())
    if size:  # full fine-tuning keeps the optimizer's state too: twice the weights
        click.echo(f"  checkpoints kept for --resume: {size / 2**30:.2f} GiB in "
                   f"{', '.join(str(d.relative_to(result.out)) for d in kept)} (delete them once you will not resume)")


@main.command()
@click.argument("name", required=False)
@click.option("--path", "show_path", is_flag=True, help="Print the file's path instead of its text (no NAME: the "
              "presets folder). NAME may also be an Accelerate config, e.g. accelerate/ddp, for "
              "`accelerate launch --config_file`.")
def presets(name, show_path):
    """List the presets, or print preset NAME.

    Presets are YAML recipes under presets/ with the sections model, data, objective, tuning, train
    and export; use one with `adapt convert --preset NAME` and override any value with --set."""
    from adapt.config.settings import RunConfig
    from adapt.config.preset_files import PRESETS_DIR, list_presets, load_preset, preset_path
    from adapt.errors import ConfigError

    found = list_presets()
    if name:
        try:
            path = preset_path(name)
        except ConfigError as e:
            raise click.BadParameter(str(e), param_hint="NAME") from None
        click.echo(path if show_path else path.read_text())
        return
    if show_path:
        click.echo(PRESETS_DIR)
        return
    for key, path in found.items():
        cfg = RunConfig.from_dict(load_preset(str(path)))
        click.echo(f"{key:<18} {cfg.description.strip().splitlines()[0] if cfg.description else ''}")


@main.command()
@click.argument("model")
@click.option("--bidirectional/--as-is", default=True, help="Make it bidirectional first (default), or probe as saved.")
@_friendly
def probe(model, bidirectional):
    """Probe MODEL: does changing the last token change the first token's hidden state?"""
    from adapt.model.bidirectional import probe as run_probe
    from adapt.config.settings import ModelConfig
    from adapt.model.loading import load_decoder

    _no_bitsandbytes()
    m, _ = load_decoder(ModelConfig(source=model), bidirectional=bidirectional)
    report = run_probe(m)
    click.echo(json.dumps(report.to_dict(), indent=2))
    sys.exit(0 if report.bidirectional else 1)


def _prompts(items):
    out = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep:
            raise click.BadParameter(f"expected NAME=TEXT, got {item!r}", param_hint="--prompt")
        out[name] = text
    return out or None


@main.command()
@click.argument("source", type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--out", required=True, type=click.Path(file_okay=False), help="Folder to write the encoder to.")
@click.option("--pooling", type=click.Choice(["mean", "weightedmean", "lasttoken", "cls"]), help="Pooling (default: as SOURCE).")
@click.option("--normalize/--no-normalize", default=None, help="L2-normalize embeddings.")
@click.option("--max-seq-length", type=int, help="Encoder max sequence length.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), help="Saved dtype.")
@click.option("--prompt", "prompts", multiple=True, metavar="NAME=TEXT", help="Named prompt, e.g. query='query: '.")
@click.option("--backend", type=click.Choice(backends.names()), default=backends.TORCH, show_default=True,
              help="Also write an ONNX or OpenVINO graph (SentenceTransformer(DIR, backend=...)); checked: probe and "
              "cosine vs torch.")
@click.option("--quantize", type=click.Choice(["int8", "int8-weights"]), help="int8: ONNX int8 weights and per-token "
              "int8 activations, outlier channels smoothed, the first MatMuls kept in float32 where needed (fastest); "
              "OpenVINO int8 weights. int8-weights: int8 weights only (ONNX MatMulNBits: slower). The int8 floor: a "
              "graph whose vectors fall below cosine 0.95 to the torch encoder's on any check text is refused and "
              "nothing is written (then use int8-weights or no --quantize).")
@click.option("--kind", type=click.Choice(kinds.names()), help=f"{kinds.help_text()} (default: as SOURCE was exported).")
@click.option("--top-k", type=int, help="Sparse: keep each vector's K largest term weights (implies --kind sparse).")
@click.option("--order-dims", type=click.Choice(["pca", "none"]), help="pca: dimensions in principal order (an "
              "orthogonal Dense layer fitted on --data: full-size similarities unchanged, any prefix a good "
              "truncate_dim); none: as pooled (default: as SOURCE was exported).")
@click.option("--data", "data", multiple=True, help="Text for --order-dims pca to fit on (files, folders; repeatable). "
              "A checkpoint defaults to its run's training data.")
@_friendly
def export(source, out, pooling, normalize, max_seq_length, dtype, prompts, backend, quantize, kind, top_k,
           order_dims, data):
    """Write an embedding encoder from SOURCE: a converted run or an encoder, or a training checkpoint
    (OUT/run/checkpoints/step-N; OUT/run/checkpoints for the newest), rebuilt from the run's config.
    With --backend onnx|openvino the folder also holds that graph, and `adapt embed` runs it. With
    --kind sparse it is a SPLADE encoder that `SparseEncoder(DIR)` loads."""
    from adapt.pipeline.reexport import export_from_path

    _no_bitsandbytes()  # --quantize is ONNX/OpenVINO int8, not bitsandbytes
    if quantize and backend == backends.TORCH:
        raise click.UsageError(f"--quantize needs --backend {' or '.join(backends.graph_backends())}")
    path = export_from_path(source, out, pooling=pooling, normalize=normalize, max_seq_length=max_seq_length,
                            prompts=_prompts(prompts), dtype=dtype, backend=backend, quantize=quantize, kind=kind,
                            top_k=top_k, order_dims=order_dims, data=list(data) or None)
    click.echo(f"exported {source} -> {path} (probe: bidirectional)")
    if backend != backends.TORCH:
        from adapt.inference.graph_model import folder_backend
        from adapt.export.graphs import describe

        click.echo(f"  {describe(folder_backend(path))}")


@main.command()
@click.argument("encoder", required=False)
@click.argument("texts", nargs=-1)
@click.option("-i", "--input", "input_path", type=click.Path(dir_okay=False), help="Texts: .txt (a line each), .jsonl, .csv, .parquet; - for stdin.")
@click.option("-o", "--output", "output_path", type=click.Path(), help="Vectors: .npy, .parquet or .jsonl (default: jsonl "
              "on stdout), or a folder (DIR/) of resumable shards + manifest. A sparse encoder writes {id, indices, "
              "values, tokens} rows to .jsonl or .parquet.")
@click.option("--field", default="text", show_default=True, help="Field/column of the text in jsonl, csv and parquet.")
@click.option("--prompt", "prompt_name", help="Prompt name stored in the encoder (e.g. query).")
@click.option("--batch-size", type=int, default=32, show_default=True)
@click.option("--max-length", type=int, help="Truncate texts to this many tokens (counted in a warning).")
@click.option("--normalize/--no-normalize", default=None, help="L2-normalize (default: as the encoder says; with "
              "--dim: yes).")
@click.option("--dim", type=click.IntRange(min=1), help="Keep the first N dimensions, re-normalized (an encoder trained "
              "with contrastive.matryoshka_dims: its model card lists the sizes).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto", show_default=True)
@click.option("--device", help="cpu, cuda, cuda:1, mps (default: best available; one GPU per process).")
@click.option("--backend", type=click.Choice(backends.names()), help="Default: the graph ENCODER holds "
              "(adapt export --backend), else torch.")
@click.option("--shards", is_flag=True, help="Resumable: -o FILE is merged from shards in FILE.shards/ (always so "
              "under torchrun / accelerate launch, and with -o DIR/).")
@click.option("--shard-size", type=int, default=10_000, show_default=True, help="Texts per shard.")
@click.option("--merge", "merge_dir", type=click.Path(file_okay=False), help="Join the finished shard folder DIR into -o "
              "FILE in input order (no ENCODER).")
@click.option("--allow-causal", is_flag=True, help="Embed with a causal model (a decoder never converted) as it is.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@_friendly
def embed(encoder, texts, input_path, output_path, field, prompt_name, batch_size, max_length, normalize, dim, dtype,
          device, backend, shards, shard_size, merge_dir, allow_causal, quiet):
    """Embed TEXT arguments, a file, or stdin with ENCODER; vectors come out in input order.

    An empty text is embedded as the tokenizer's empty input (its special tokens, or EOS when it
    has none) and counted in a warning; it is never dropped, so output rows match input rows.

    Several processes: `torchrun --nproc_per_node N -m adapt embed ENCODER -i FILE -o DIR/` (or
    `accelerate launch --multi_gpu --num_processes N -m adapt embed ...`): each embeds its share of
    the shards; a rerun of the same command skips the finished ones."""
    from adapt.inference.embed import embed as run
    from adapt.inference.embed import merge_shards

    _no_bitsandbytes()
    if merge_dir:
        if encoder or texts or input_path:
            raise click.UsageError("--merge DIR takes no ENCODER, TEXT or --input: it joins DIR's shards into -o FILE")
        summary = merge_shards(merge_dir, output_path)
        click.echo(f"merged {summary.n:,} vectors from {merge_dir} -> {summary.output} ({summary.dim} dims)", err=True)
        return
    if encoder is None:
        raise click.UsageError("give ENCODER (or --merge DIR -o FILE)")
    if not texts and input_path is None and not sys.stdin.isatty():
        input_path = "-"
    if not texts and input_path is None:
        raise click.UsageError("give TEXT arguments, --input FILE, or pipe texts on stdin")
    summary = run(encoder, texts=list(texts) or None, input_path=input_path, output_path=output_path, field=field,
                  prompt_name=prompt_name, batch_size=batch_size, max_length=max_length, normalize=normalize,
                  dtype=dtype, device=device, show_progress=not quiet, allow_causal=allow_causal, backend=backend,
                  shards=shards, shard_size=shard_size, dim=dim)
    if output_path and int(os.environ.get("RANK", 0)) == 0:
        click.echo(f"embedded {summary.n} texts -> {summary.output} ({summary.dim} dims, {summary.seconds:.1f} s)", err=True)
        click.echo(summary.rate_line(), err=True)


@main.command()
@click.argument("encoder")
@click.option("--data", "train_path", required=True, type=click.Path(exists=True, dir_okay=False), help="Labeled training text (.jsonl, .csv, .parquet).")
@click.option("--eval", "eval_path", type=click.Path(exists=True, dir_okay=False), help="Dev split for early stopping (default: 20% of --data).")
@click.option("-o", "--out", required=True, type=click.Path(file_okay=False))
@click.option("--kind", type=click.Choice(["sequence", "pair", "token"]), default="sequence", show_default=True,
              help="sequence: a label a text; pair: a label a pair of texts (--pair-field); token: a tag a word "
              "(fields tokens and tags, saved for pipeline('token-classification')).")
@click.option("--text-field", help="default: text (token: tokens)")
@click.option("--label-field", help="default: label (token: tags)")
@click.option("--pair-field", default="text_pair", show_default=True, help="--kind pair: the second text's field.")
@click.option("--tuning", type=click.Choice(["full", "lora"]), default="full", show_default=True)
@click.option("--epochs", type=int, default=3, show_default=True)
@click.option("--lr", type=float)
@click.option("--batch-size", type=int, default=16, show_default=True)
@click.option("--max-length", type=int, default=256, show_default=True)
@click.option("--patience", type=int, default=2, show_default=True, help="Epochs without dev improvement before stopping.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--quiet", is_flag=True)
@_friendly
def finetune(encoder, train_path, eval_path, out, kind, text_field, label_field, pair_field, tuning, epochs, lr,
             batch_size, max_length, patience, seed, quiet):
    """Fine-tune ENCODER into a sequence, pair or token classifier that plain transformers loads (pipeline,
    AutoModelForSequenceClassification, AutoModelForTokenClassification)."""
    from adapt.pipeline.finetune import finetune as run

    _no_bitsandbytes()
    metrics = run(encoder, train_path, out, eval_path=eval_path, text_field=text_field, label_field=label_field,
                  kind=kind, pair_field=pair_field, tuning=tuning, epochs=epochs, lr=lr, batch_size=batch_size, max_length=max_length,
                  patience=patience, seed=seed, show_progress=not quiet)
    click.echo(json.dumps(metrics, indent=2, default=str))


@main.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("texts", nargs=-1)
@click.option("-i", "--input", "input_path", type=click.Path(dir_okay=False), help=".txt, .jsonl, .csv or .parquet.")
@click.option("-o", "--output", "output_path", type=click.Path(dir_okay=False), help="Write labels and probabilities as .jsonl.")
@click.option("--field", default="text", show_default=True)
@click.option("--batch-size", type=int, default=32, show_default=True)
@_friendly
def classify(model_dir, texts, input_path, output_path, field, batch_size):
    """Label TEXT arguments or a file with a classifier made by `adapt finetune`."""
    from adapt.pipeline.finetune import classify as run

    _no_bitsandbytes()
    if not texts and input_path is None:
        raise click.UsageError("give TEXT arguments or --input FILE")
    rows = run(model_dir, input_path=input_path, texts=list(texts) or None, output_path=output_path, field=field,
               batch_size=batch_size)
    if not output_path:
        for row in rows:
            click.echo(json.dumps(row))


@main.command()
@click.argument("models", nargs=-1, required=True)
@click.option("--suite", help="Task suite: quick (offline, minutes), standard (offline, 8 tasks, test split), "
              "standard-dev (its dev split: choose recipes there), finetune (each model fine-tuned, LoRA, 3 seeds, "
              "on 7 classification, pair and token tasks; test items), finetune-dev (its dev items), mteb-lite "
              "(needs a network).")
@click.option("--task", "tasks", multiple=True, help="A task name, or a task folder (BEIR retrieval, train/test jsonl, pairs.jsonl). Repeatable.")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False), default="bench-results", show_default=True)
@click.option("--baselines", is_flag=True, help="Also score each converted model's source decoder (causal: mean, "
              "last token, mean after a sink prompt; bidirectional untrained), BM25 on retrieval tasks and all-MiniLM-L6-v2 as a reference.")
@click.option("--source", help="Source decoder for --baselines (default: read from MODEL/run/config.yaml).")
@click.option("--batch-size", type=int, default=32, show_default=True)
@click.option("--max-length", type=int, default=256, show_default=True)
@click.option("--limit", type=int, help="At most this many examples per task (quick looks).")
@click.option("--no-cache", is_flag=True, help="Re-encode even when cached embeddings exist.")
@click.option("--no-card", is_flag=True, help="Do not write the scores into the model cards of adapt encoders.")
@click.option("--dims", help="Score each model's vectors cut to each of these sizes, e.g. full,256,64 (Matryoshka): "
              "rows NAME@dim=N.")
@click.option("--seeds", type=int, help="Fine-tuned suites: fine-tuning seeds per model and task (default 3).")
@click.option("--quiet", is_flag=True)
@_friendly
def bench(models, suite, tasks, out_dir, baselines, source, batch_size, max_length, limit, no_cache, no_card, dims,
          seeds, quiet):
    """Benchmark MODELS (encoders, converted runs, raw decoders as PATH@pooling=last,bidirectional=false,
    sentence-transformers models) on retrieval, classification and similarity, side by side.

    Several processes: `torchrun --nproc_per_node N -m adapt bench MODEL ...` (or `accelerate launch
    --multi_gpu --num_processes N -m adapt bench ...`): each encodes its share of every task's texts;
    process 0 scores (the same scores as one process) and writes the reports."""
    from adapt.bench.runner import run_bench, task_refs

    _no_bitsandbytes()
    if suite is None and not tasks:
        suite = "quick"
    tasks = list(tasks)
    if suite and tasks:  # both: the suite's tasks, then the named ones
        tasks = [t for t in task_refs(suite, None) if t not in tasks] + tasks
    report = run_bench(list(models), suite=suite, tasks=tasks or None, out_dir=out_dir, baselines=baselines,
                       source=source, batch_size=batch_size, max_length=max_length, limit=limit,
                       show_progress=not quiet, use_cache=not no_cache, update_cards=not no_card, dims=dims,
                       seeds=seeds)
    if report is not None:  # None in processes other than 0 of a multi-process launch
        click.echo(report.markdown)


if __name__ == "__main__":
    main()
