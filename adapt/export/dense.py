"""Write a bidirectional model as a sentence-transformers folder that loads with no custom code.

Layout of ``OUT`` (``OUT/run/`` with the training run's own files is never touched)::

    config.json  model.safetensors  tokenizer*     the backbone (``AutoModel``), ``"is_causal": false``
    modules.json  sentence_bert_config.json         Transformer at the root, attention pinned if needed
    config_sentence_transformers.json               prompts, cosine similarity, matryoshka_dims (if trained)
    1_Pooling/  [2_Dense/]  [N_Normalize/]          pooling (mean, weightedmean, last, cls); the principal-axes
                                                    rotation (``export.order_dims: pca``, adapt.export.dim_order)
    README.md  adapt_export.json                    model card; what adapt wrote (for re-export)

The export is assembled by sentence-transformers itself (``SentenceTransformer(modules=...).save``) in a
temporary sibling folder, reloaded exactly as a user would load it, probed for bidirectionality, and
only then moved into ``OUT`` file by file (``modules.json`` last), so a user never loads a half-written
or causal encoder. The LM head is not exported: an encoder needs only the backbone.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path


from adapt.model.families import preferred_attention
from adapt.model.bidirectional import assert_bidirectional, is_bidirectional
from adapt.errors import ConfigError, ModelLoadError, NotBidirectionalError
from adapt.export import kinds
from adapt.export.backends import graph_backends
from adapt.files import atomic_write_text, read_json
from adapt.config.run_folder import RUN
from adapt.model.loading import parse_dtype
from adapt.model.pooling import POOLINGS, check_sink, pooling_name, sink_prompts

MANIFEST = "adapt_export.json"
_TEXT_ONLY = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}


def pin_attention(folder, attn: str) -> None:
    """Write ``attn_implementation`` into ``folder/config.json`` when it is not transformers' default.

    ``save_pretrained`` does not persist it, but ``from_pretrained`` reads it from config.json, so a plain
    ``AutoModel.from_pretrained(folder)`` (or pipeline) then runs the implementation under which the
    family honours ``is_causal=False`` (StableLM's SDPA path stays causal without padding). An explicit
    ``attn_implementation=`` still overrides it.
    """
    if attn == "sdpa":
        return
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["attn_implementation"] = attn
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def prepare_tokenizer(tokenizer, folder: Path, max_seq_length: int | None):
    """Save a copy of ``tokenizer`` to ``folder`` with right padding, a pad token and a max length."""
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "right"
    if tok.pad_token is None:
        fallback = tok.eos_token or tok.unk_token or tok.bos_token
        if fallback is None:
            raise ConfigError("the tokenizer has no pad, eos, unk or bos token to pad with; add a pad token first")
        tok.pad_token = fallback
    if max_seq_length:
        tok.model_max_length = int(max_seq_length)
    tok.save_pretrained(folder)
    return tok


def backbone_of(model):
    """The base transformers model (no LM head) of a causal LM, a base model or a peft wrapper."""
    model = getattr(model, "module", model)  # DDP / FSDP
    if hasattr(model, "peft_config") and hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()  # LoRA weights folded in: the export needs no peft
    return getattr(model, "base_model", model)


def export_target(model, out_dir, max_seq_length: int | None) -> tuple[Path, int | None]:
    """Checks every export makes first: ``model`` is bidirectional (else :class:`NotBidirectionalError`) and
    ``out_dir`` is not a file; returns it as a Path and ``max_seq_length`` cut to the model's positions."""
    config = model.config
    if not is_bidirectional(model):
        raise NotBidirectionalError(f"refusing to export: the '{config.model_type}' model is causal "
                                    "(config.is_causal is not False); make it bidirectional first")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir} exists and is not a folder")
    max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if max_positions and max_seq_length and max_seq_length > max_positions:
        max_seq_length = int(max_positions)
    return out_dir, max_seq_length


def export_encoder(model, tokenizer, out_dir, *, pooling: str = "mean", normalize: bool = False,
                   max_seq_length: int = 512, prompts: dict[str, str] | None = None, dtype=None,
                   card: dict | None = None, source: str | None = None,
                   matryoshka_dims: list[int] | None = None, rotation=None, order: dict | None = None,
                   sink_prompt: str = "") -> Path:
    """Write ``model`` (bidirectional, in memory) and ``tokenizer`` to ``out_dir`` as a sentence-transformers encoder.

    ``dtype``: bf16/fp16/fp32 for the saved weights (None keeps the model's). ``prompts``: named
    prefixes, e.g. ``{"query": "query: ", "document": ""}`` for ``encode(..., prompt_name="query")``.
    ``card``: what the model card reports (see :func:`render_card`). ``matryoshka_dims``: the sizes the
    encoder was trained to be truncated to (``contrastive.matryoshka_dims``), recorded in
    config_sentence_transformers.json, the manifest and the card so users pick a ``truncate_dim``.
    ``rotation``: an orthogonal ``(H, H)`` matrix applied to the pooled vector as a ``Dense`` layer (dimensions in
    principal order, :mod:`adapt.export.dim_order`); ``order`` is what the manifest records of how it was fitted. Raises
    :class:`NotBidirectionalError` (leaving ``out_dir`` as it was) if the reloaded folder is causal.
    ``sink_prompt`` (``export.sink_prompt``): put before every prompt, a prompt named ``default`` that is the sink
    alone (used when none is asked for), and every prompt left out of pooling (:func:`adapt.model.pooling.sink_prompts`);
    the manifest keeps ``prompts`` as given and the sink apart.
    """
    pooling = pooling_name(pooling)
    check_sink(tokenizer, sink_prompt, prompts=prompts)
    st_prompts, default_prompt, include_prompt = sink_prompts(prompts, sink_prompt)
    torch_dtype = parse_dtype(dtype)
    backbone = backbone_of(model)
    config = backbone.config
    out_dir, max_seq_length = export_target(backbone, out_dir, max_seq_length)
    attn = preferred_attention(config)
    dims = check_truncate_dims(matryoshka_dims, int(config.get_text_config().hidden_size), config.model_type)
    rotation = check_rotation(rotation, int(config.get_text_config().hidden_size))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.export.", dir=out_dir.parent))
    try:
        stage, built = scratch / "stage", scratch / "built"
        tok = prepare_tokenizer(tokenizer, stage, max_seq_length)
        saved = (config.architectures, config.pad_token_id)
        try:
            if config.pad_token_id is None:
                config.pad_token_id = tok.pad_token_id
            backbone.save_pretrained(stage)
        finally:
            config.architectures, config.pad_token_id = saved
        model_dtype = torch_dtype or next(backbone.parameters()).dtype
        _build(stage, built, pooling=pooling, normalize=normalize, prompts=st_prompts, attn=attn, dtype=model_dtype,
               dims=dims, rotation=rotation, default_prompt=default_prompt, include_prompt=include_prompt)
        report = probe_folder(built, where=f"export to {out_dir}")
        manifest = {"adapt_export": 1, "source": source, "pooling": pooling, "normalize": bool(normalize),
                    "dtype": str(model_dtype).removeprefix("torch."), "max_seq_length": max_seq_length,
                    "attn_implementation": attn, "prompts": prompts or {}, "sink_prompt": sink_prompt,
                    "matryoshka_dims": dims, "card": card or {},
                    "order_dims": (order or {"method": "given"}) if rotation is not None else None,
                    "probe": report.to_dict()}
        publish(built, out_dir, manifest)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out_dir


def publish(built: Path, out_dir: Path, manifest: dict) -> None:
    """Finish a checked export: its model card and manifest (listing every file) into ``built``, then ``built``
    moved into ``out_dir`` whole (:func:`move_into`)."""
    (built / "README.md").write_text(render_card(out_dir.name, manifest), encoding="utf-8")
    manifest["files"] = sorted(p.name for p in built.iterdir()) + [MANIFEST]
    (built / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str) + "\n", encoding="utf-8")
    move_into(built, out_dir)


def check_truncate_dims(dims, hidden_size: int, family: str = "") -> list[int]:
    """Matryoshka sizes as the export records them: distinct whole numbers up to ``hidden_size``, largest first."""
    dims = list(dims or [])
    bad = [d for d in dims if isinstance(d, bool) or not isinstance(d, int) or not 0 < d <= hidden_size]
    if bad or len(set(dims)) != len(dims):
        raise ConfigError(f"matryoshka_dims {dims}: each must be a distinct size from 1 to the {family} model's "
                          f"hidden size {hidden_size}")
    return sorted(dims, reverse=True)


def check_rotation(rotation, hidden_size: int):
    """``rotation`` as a float32 ``(H, H)`` tensor, checked orthogonal (None stays None)."""
    import torch

    if rotation is None:
        return None
    rotation = torch.as_tensor(rotation, dtype=torch.float32).detach().cpu()
    if tuple(rotation.shape) != (hidden_size, hidden_size):
        raise ConfigError(f"the dimension-order rotation is {tuple(rotation.shape)}, not ({hidden_size}, {hidden_size}): "
                          "it was fitted for another model")
    error = (rotation @ rotation.T - torch.eye(hidden_size)).abs().max().item()
    if error > 1e-3:
        raise ConfigError(f"the dimension-order rotation is not orthogonal (|Q Q^T - I| reaches {error:.2g}): it "
                          "would change similarities at full size")
    return rotation


def _build(stage: Path, built: Path, *, pooling, normalize, prompts, attn, dtype, dims=(), rotation=None,
           default_prompt=None, include_prompt=True) -> None:
    """Assemble the sentence-transformers modules from the staged backbone and save them to ``built``."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    transformer = Transformer(str(stage), model_kwargs={"attn_implementation": attn, "dtype": dtype},
                              modality_config=_TEXT_ONLY, module_output_name="token_embeddings")
    size = transformer.get_embedding_dimension()
    modules = [transformer, Pooling(size, pooling_mode=POOLINGS[pooling], include_prompt=include_prompt)]
    if rotation is not None:  # fp32 whatever the backbone's dtype: it runs on the fp32 pooled vector
        modules.append(Dense(size, size, bias=False, activation_function=torch.nn.Identity(), init_weight=rotation))
    if normalize:
        modules.append(Normalize())
    st = SentenceTransformer(modules=modules, prompts=dict(prompts or {}), default_prompt_name=default_prompt,
                             similarity_fn_name="cosine", device="cpu")
    st.save(str(built), create_model_card=False)
    pin_attention(built, attn)
    if dims:  # sentence-transformers ignores the key; `truncate_dim` there would truncate every load
        path = built / "config_sentence_transformers.json"
        path.write_text(json.dumps({**json.loads(path.read_text(encoding="utf-8")), "matryoshka_dims": dims},
                                   indent=2) + "\n", encoding="utf-8")
    if attn != "sdpa":
        # transformers does not persist the attention implementation in config.json, but
        # sentence-transformers passes these model_kwargs to from_pretrained on every load.
        path = built / Transformer.config_file_name
        st_config = json.loads(path.read_text(encoding="utf-8"))
        st_config["model_kwargs"] = {"attn_implementation": attn}
        path.write_text(json.dumps(st_config, indent=4) + "\n", encoding="utf-8")


def probe_folder(folder, *, where: str = ""):
    """Load ``folder`` as sentence-transformers loads it and assert that its backbone is bidirectional."""
    from sentence_transformers import SentenceTransformer

    try:
        st = SentenceTransformer(str(folder), device="cpu")
    except Exception as err:  # noqa: BLE001 - any load failure means the export is unusable
        raise ModelLoadError(f"{where or folder}: sentence-transformers cannot load the export: {err}") from err
    return assert_bidirectional(st[0].auto_model, where=where)


def move_into(built: Path, out_dir: Path) -> None:
    """Move the export's files into ``out_dir`` without touching ``run/``; ``modules.json`` goes last."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "modules.json").unlink(missing_ok=True)  # mid-swap, the folder is not an encoder at all
    new = {p.name for p in built.iterdir()}
    old_manifest = out_dir / MANIFEST
    if old_manifest.exists():
        try:
            stale = set(json.loads(old_manifest.read_text(encoding="utf-8")).get("files", [])) - new
        except (json.JSONDecodeError, OSError):
            stale = set()
        for name in stale - {RUN}:
            _remove(out_dir / name)
    for name in sorted(new - {"modules.json", RUN}):
        _remove(out_dir / name)
        os.replace(built / name, out_dir / name)
    os.replace(built / "modules.json", out_dir / "modules.json")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def record_bench(folder, scores: dict) -> bool:
    """Put a benchmark table in the model card of an encoder adapt exported: ``scores`` is either
    ``{"columns": [this encoder, baseline, ...], "rows": [{"task", "kind", "metric", "values": [one per
    column], "ci": [low, high] of this encoder}], "title": ..., "verdict": line}`` or a flat
    ``{"task (metric)": value}`` mapping.

    Rewrites ``adapt_export.json`` and ``README.md`` (each atomically); the weights are not touched.
    Returns False, changing nothing, for a folder adapt did not export.
    """
    folder = Path(folder)
    manifest = read_json(folder / MANIFEST)
    if not manifest.get("adapt_export") or not scores:
        return False
    manifest["card"] = {**(manifest.get("card") or {}), "bench": dict(scores)}
    atomic_write_text(folder / "README.md", render_card(folder.name, manifest))
    atomic_write_text(folder / MANIFEST, json.dumps(manifest, indent=2, default=str) + "\n")
    return True


def render_card(name: str, manifest: dict) -> str:
    """The model card (README.md) from ``manifest["card"]``, the dict the caller passes: ``final_eval``
    / ``metrics`` (final training figures), ``bench`` (``{task: score}``), ``recipe`` (the full run
    config, shown as JSON) and any other keys (objective, steps, mask_ratio, tuning, ...) as the recipe table."""
    card = portable(dict(manifest.get("card") or {}))
    metrics = card.pop("final_eval", None) or card.pop("metrics", None) or card.pop("final", None) or {}
    bench = card.pop("bench", None) or card.pop("benchmark", None) or {}
    full_recipe = card.pop("recipe", None)
    source = portable(manifest.get("source") or card.get("source") or "unknown")
    kind = kinds.of_manifest(manifest)
    lines = ["---", "library_name: sentence-transformers", f"pipeline_tag: {kind.pipeline_tag}",
             f"tags: [sentence-transformers, {kind.tags}, bidirectional, adapt]"]
    raw_source = str(manifest.get("source") or "")
    if raw_source and not os.path.isabs(raw_source) and not os.path.exists(raw_source) and ":" not in raw_source:
        lines.append(f"base_model: {raw_source}")  # a hub id
    cls = kind.st_class
    lines += ["---", "", f"# {name}", "",
              f"A bidirectional {kind.noun} converted by `adapt` from the causal decoder `{source}`: its attention "
              "sees the whole text (`\"is_causal\": false` in config.json), adapted as the recipe below says.", "",
              "## Usage", "", "```python", f"from sentence_transformers import {cls}",
              f'model = {cls}("{name}")', 'vectors = model.encode(["A first text.", "Another one."])']
    lines += [*kind.usage, "```", "", f'Or `adapt embed {name} "A first text."`. ' + kind.note]
    lines += _backend_usage(name, manifest.get("backend")) + [""]
    dims = manifest.get("matryoshka_dims") or []
    if len(dims) > 1:
        lines += [f"Trained for truncation (Matryoshka) to {', '.join(map(str, dims))} dimensions: "
                  f'`SentenceTransformer("{name}", truncate_dim={dims[1]})`, or `adapt embed {name} --dim {dims[1]}` '
                  "(re-normalized).", ""]
    lines += ["## Encoder", "", "| setting | value |", "|---|---|", f"| pooling | {manifest['pooling']} |",
              kind.setting(manifest)]
    lines += [f"| max sequence length | {manifest['max_seq_length']} |", f"| dtype | {manifest['dtype']} |",
              f"| attention | {manifest['attn_implementation']} |"]
    lines += [f"| prompt `{key}` | `{value!r}` |" for key, value in (manifest.get("prompts") or {}).items()]
    if manifest.get("sink_prompt"):
        lines.append(f"| sink prompt | `{manifest['sink_prompt']!r}` before every text (the default prompt), left out "
                     "of pooling with the prompts: the decoder's first position is an attention sink |")
    dims = manifest.get("matryoshka_dims") or []
    if dims:
        lines.append(f"| Matryoshka sizes (`truncate_dim`) | {', '.join(map(str, dims))} |")
    order = manifest.get("order_dims") or {}
    if order:
        fitted = f", fitted on {order['texts']} training texts" if order.get("texts") else ""
        lines.append(f"| dimensions | in principal order (a rotation, `order_dims: {order.get('method')}`{fitted}): "
                     "any prefix is a good `truncate_dim` |")
    probe = manifest.get("probe") or {}
    if probe:
        lines.append(f"| bidirectionality probe: first-token change (unpadded / right / left padding) | "
                     f"{probe['unpadded']:.3g} / {probe['right_padded']:.3g} / {probe['left_padded']:.3g} |")
    lines += ["", "## Recipe", ""] + (_table(card) if card else ["Exported without training."])
    if full_recipe:
        lines += ["", "<details><summary>full run configuration</summary>", "", "```json",
                  json.dumps(full_recipe, indent=2, default=str), "```", "", "</details>"]
    lines += ["", "## Training figures", ""] + (_table(metrics) if metrics else ["None recorded."])
    lines += ["", "## Benchmark", ""] + (_bench_table(bench) if "columns" in bench else _table(bench) if bench
                                         else ["Not benchmarked yet: run `adapt bench`."])
    return "\n".join(lines) + "\n"


def _backend_usage(name: str, backend: dict | None) -> list[str]:
    """Card lines for the graph the folder holds (``manifest["backend"]``), if any: what sentence-transformers needs
    to run it, as each backend of :mod:`adapt.export.backends` says (verified: README.md, "ONNX and OpenVINO")."""
    spec = graph_backends().get((backend or {}).get("name"))
    if spec is None:
        return []
    parity = backend.get("parity") or {}
    return ["", f"The folder also holds a checked {spec.name} graph (`{backend.get('file')}`, "
            f"{backend.get('quantize') or 'float32'}; cosine vs "
            f"torch min {parity.get('min_cosine')}):", "", "```python",
            f'model = SentenceTransformer("{name}", backend="{spec.name}"{spec.st_kwargs})', "```", "",
            f"It needs {spec.st_needs}"]


def portable(value):
    """``value`` with every absolute path of this machine cut to its last two parts (``.../parent/name``):
    a model card travels, and where it was made says nothing to its reader."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(portable(v) for v in value)
    if isinstance(value, str) and os.path.isabs(value) and "\n" not in value:
        parts = Path(value).parts
        return ".../" + "/".join(parts[-2:]) if len(parts) > 2 else value
    return value


def _bench_table(bench: dict) -> list[str]:
    """This encoder's main scores (with their 95% interval) next to its source's, one task a row."""
    def num(value):
        return "-" if value is None else f"{value:.3f}"

    columns = bench["columns"]
    lines = [f"{bench.get('title') or 'adapt bench'}: main metric per task, this encoder's bootstrap 95% "
             "interval in brackets, its source decoder scored the same way beside it.", "",
             "| task | kind | metric | this encoder | " + " | ".join(columns[1:]) + " |",
             "|---|---|---|---|" + "---|" * (len(columns) - 1)]
    for row in bench["rows"]:
        mine, *others = row["values"]
        low, high = row.get("ci") or (None, None)
        interval = f" [{low:.3f}, {high:.3f}]" if low is not None and high is not None else ""
        lines.append(f"| {row['task']} | {row['kind']} | {row['metric']} | {num(mine)}{interval} | "
                     + " | ".join(num(v) for v in others) + " |")
    if bench.get("verdict"):
        lines += ["", bench["verdict"]]
    return lines


def _table(values: dict) -> list[str]:
    def fmt(value):
        if isinstance(value, float):
            return f"{value:.4g}"
        return value if isinstance(value, str) else json.dumps(value, default=str)
    return ["| key | value |", "|---|---|", *(f"| {key} | {fmt(value)} |" for key, value in values.items())]
