"""The ``adapt`` command line: a thin click layer over the library.

    adapt convert MODEL -o OUT [--preset NAME] [--data PATH ...] [--objective mlm|mntp|clm] [--tuning full|lora|qlora]
    adapt presets [NAME]            list presets, or show one
    adapt probe MODEL               is this model bidirectional?
    adapt export SOURCE -o DIR      write an embedding encoder with another pooling or dtype
    adapt embed ENCODER [TEXT ...]  embed text
    adapt finetune ENCODER --data TRAIN -o DIR / adapt classify DIR --input FILE
    adapt bench MODEL [MODEL ...]   retrieval, classification and similarity, side by side

Several processes: ``accelerate launch --config_file presets/accelerate/ddp.yaml -m adapt convert ...``.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import sys

import click

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("-v", "--verbose", is_flag=True, help="Log more.")
def main(verbose):
    """adapt: turn any causal decoder LLM into a bidirectional encoder (MLM continued pretraining),
    export it for sentence-transformers / transformers / mteb, embed text and benchmark it."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


@main.command()
@click.argument("model", required=False)
@click.option("-o", "--out", required=True, type=click.Path(file_okay=False), help="Output folder (encoder + run/).")
@click.option("--preset", help="Recipe from presets/ (see `adapt presets`) or a YAML path.")
@click.option("--data", multiple=True, help="Training text: .txt, .jsonl, .parquet, a folder, hf:NAME, gensim:FILE. Repeatable.")
@click.option("--objective", help="mlm, mntp or clm (mixtures and phases: in a preset or --set objective.schedule=...).")
@click.option("--tuning", type=click.Choice(["full", "lora", "qlora"]), help="Full fine-tuning, LoRA or QLoRA.")
@click.option("--max-steps", type=int, help="Optimizer steps.")
@click.option("--resume", is_flag=True, help="Continue the run in OUT from its last checkpoint.")
@click.option("--overwrite", is_flag=True, help="Replace whatever OUT holds.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override any setting, e.g. train.lr=1e-4.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@_friendly
def convert(model, out, preset, data, objective, tuning, max_steps, resume, overwrite, overrides, quiet):
    """Convert MODEL (a folder, hub id, .gguf file or py:PACKAGE) into a bidirectional encoder at OUT."""
    from adapt.convert import convert as run

    result = run(model, out, preset=preset, overrides=list(overrides), data=list(data) or None, objective=objective,
                 tuning=tuning, max_steps=max_steps, resume=resume, overwrite=overwrite, show_progress=not quiet)
    if result.summary:
        s = result.summary
        click.echo(f"converted {s['source']} ({s['model_type']}) -> {result.out}")
        click.echo(f"  steps {s['steps']}, tokens {s['tokens']:,}, {s['train_seconds']} s training, {s['wall_seconds']} s in all")
        for k, v in sorted(s["final_eval"].items()):
            click.echo(f"  {k} = {v:.4f}")
        click.echo(f"  probe after reload: first-token change {s['probe_after']['unpadded']:.3g} (bidirectional)")
        click.echo(f"  loss curve: {s['loss_plot']}")


@main.command()
@click.argument("name", required=False)
def presets(name):
    """List the presets, or print preset NAME."""
    from adapt.config import RunConfig, list_presets, load_preset

    found = list_presets()
    if name:
        if name not in found:
            raise click.BadParameter(f"no preset {name!r}; available: {', '.join(found)}", param_hint="NAME")
        click.echo(found[name].read_text())
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
    from adapt.bidirectional import probe as run_probe
    from adapt.config import ModelConfig
    from adapt.loading import load_decoder

    m, _ = load_decoder(ModelConfig(source=model), bidirectional=bidirectional)
    report = run_probe(m)
    click.echo(json.dumps(report.to_dict(), indent=2))
    sys.exit(0 if report.bidirectional else 1)


if __name__ == "__main__":
    main()
