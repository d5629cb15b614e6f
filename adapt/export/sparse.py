"""Write a bidirectional causal LM with its head as a SPLADE encoder that plain ``SparseEncoder(DIR)`` loads.

No custom code and no ``trust_remote_code``: sentence-transformers' own modules, in one of two layouts::

    most families     Transformer(transformer_task="text-generation")  the *ForCausalLM, all token logits
                      -> SpladePooling("max", "relu")                  (``logits_to_keep: 0``)
    absolute-position Transformer (the backbone) -> Dense(H -> V, the LM head, no activation)
    families (GPT-2), -> SpladePooling("max", "relu")
    and a term bias

Inference-free queries (``splade.queries: idf``) put both behind a ``Router``: queries go to a
``SparseStaticEmbedding`` of the terms' IDF (no model run), documents to the modules above, whose Transformer
the router finds at the root (its route's module path is the folder itself), so the root stays a causal-LM
folder that transformers and a re-export load.

A SPLADE stage's trained term bias (:class:`adapt.model.splade.SparseLM`) goes into the Dense layer's bias, with
the head's own bias and the scalar some families multiply their logits by (:func:`adapt.model.families.head_logit_scale`)
folded in; a family that soft-caps its logits cannot carry one (refused).

sentence-transformers pads a text-generation module on the left and passes no position ids, which the
rotary families do not mind (the probe and the padding check prove it) but learned absolute positions
do; the backbone path pads on the right, where positions start at 0. Both store the causal LM at the
root (``config.json`` with ``"is_causal": false``; the backbone layout, its untied head beside it in
``lm_head.safetensors``), so ``adapt export DIR --kind sparse`` can re-export it, and ``config_sentence_transformers.json`` says dot-product similarity and, with ``top_k``,
``max_active_dims``. As for a dense export (:mod:`adapt.export.dense`), the folder is assembled in a scratch
folder, reloaded as a user loads it, probed for bidirectionality on the SparseEncoder's own model, checked
to give the same vector to a text whether or not it is padded, and only then moved into ``OUT``.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from adapt.model.families import facts_for, head_logit_scale, preferred_attention
from adapt.model.bidirectional import assert_bidirectional, is_bidirectional
from adapt.config.settings import ModelConfig
from adapt.errors import ConfigError, ModelLoadError, NotBidirectionalError
from adapt.export.kinds import SPARSE
from adapt.export.dense import MANIFEST, export_target, pin_attention, prepare_tokenizer, publish
from adapt.model.lm_head import save_lm_head
from adapt.files import read_json
from adapt.model.loading import load_decoder, parse_dtype
from adapt.model.splade import query_prefix

POOLING = "splade-max"  # max over tokens of log1p(relu(logits)), as adapt.model.splade.splade_pool
_LOGITS = {"text": {"method": "forward", "method_output_name": "logits"}}
_HIDDEN = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
ROUTER_CONFIG = "router_config.json"
_PADDING_TEXTS = ("A short text.", "A much longer text, with many more words in it, so that the short one is padded "
                  "when the two are encoded together in one batch.")


SPARSE_ST = "6.2.0"  # the first sentence-transformers that runs this module's exports as written


def sparse_supported() -> bool:
    """Whether the installed sentence-transformers runs adapt's sparse encoders: from 6.2 a text-generation
    module honours ``logits_to_keep: 0`` (every token's logits; before, the last token's only) and a
    SparseEncoder saves ``max_active_dims`` (before, top-k pruning is lost on reload)."""
    from importlib.metadata import version

    from packaging.version import Version

    return Version(version("sentence-transformers")) >= Version(SPARSE_ST)


def require_sparse_support(what: str = "SPLADE sparse encoders") -> None:
    """Raise :class:`ConfigError` with the fix unless :func:`sparse_supported`."""
    if not sparse_supported():
        from importlib.metadata import version

        raise ConfigError(f"{what} need sentence-transformers >= {SPARSE_ST} (installed: "
                          f"{version('sentence-transformers')}; older versions give a causal LM's last-token logits "
                          f"only and drop top-k pruning on reload): pip install -U 'sentence-transformers>={SPARSE_ST}'")


def is_sparse_folder(folder) -> bool:
    """Whether ``folder`` is a sentence-transformers SparseEncoder (``SparseEncoder(folder)`` loads it)."""
    folder = Path(folder)
    if read_json(folder / "config_sentence_transformers.json").get("model_type") == "SparseEncoder":
        return True
    try:
        modules = json.loads((folder / "modules.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return any(str(m.get("type", "")).endswith(("SpladePooling", "SparseAutoEncoder")) for m in modules)


def _causal_lm(model):
    """The transformers causal LM inside a DDP or peft wrapper, LoRA merged in; refused without an LM head."""
    model = getattr(model, "module", model)
    if hasattr(model, "peft_config") and hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    if getattr(model, "get_output_embeddings", lambda: None)() is None:
        raise ModelLoadError(f"a sparse encoder is made of an LM head, and this {type(model).__name__} has none: load "
                             "the model as a causal LM (adapt.model.loading.load_decoder)")
    return model


def export_sparse(model, tokenizer, out_dir, *, top_k: int | None = None, max_seq_length: int = 512,
                  prompts: dict[str, str] | None = None, dtype=None, card: dict | None = None,
                  source: str | None = None, term_bias: torch.Tensor | None = None,
                  query_idf: torch.Tensor | None = None) -> Path:
    """Write ``model`` (a bidirectional causal LM with its head, in memory) to ``out_dir`` as a SPLADE SparseEncoder.

    ``top_k``: keep each vector's k largest weights (``max_active_dims``). ``dtype``: bf16/fp16/fp32 for the
    saved weights (None keeps the model's). ``term_bias`` (V): added to the logits before relu, as a SPLADE
    stage trains it. ``query_idf`` (V): inference-free queries weighted by it (a ``Router``; the query prompt
    gets the leading space :func:`adapt.model.splade.query_prefix` asks for). Raises :class:`NotBidirectionalError`
    (``out_dir`` unchanged) if the reloaded folder is causal, :class:`ModelLoadError` if its vectors depend on
    padding.
    """
    if top_k is not None and (isinstance(top_k, bool) or int(top_k) <= 0):
        raise ConfigError(f"top_k must be a positive number of terms, not {top_k!r}")
    require_sparse_support("sparse exports")
    lm = _causal_lm(model)
    config = lm.config
    vocab = lm.get_output_embeddings().weight.shape[0]
    if term_bias is not None:
        term_bias = term_bias.detach().float().cpu().flatten()
        if term_bias.shape[0] != vocab:
            raise ConfigError(f"term_bias has {term_bias.shape[0]} terms and the LM head {vocab}: it belongs to "
                              "another model")
    if query_idf is not None:
        query_idf = query_idf.detach().float().cpu().flatten()
        if query_idf.shape[0] != vocab:
            raise ConfigError(f"query_idf has {query_idf.shape[0]} terms and the LM head {vocab}: it belongs to "
                              "another model")
        prefix, prompts = query_prefix(tokenizer), dict(prompts or {})
        if prefix and not prompts.get("query", "").startswith(prefix):
            prompts["query"] = prefix + prompts.get("query", "")
    out_dir, max_seq_length = export_target(lm, out_dir, max_seq_length)
    attn, model_dtype = preferred_attention(config), parse_dtype(dtype) or next(lm.parameters()).dtype
    dense = term_bias is not None or facts_for(config).absolute_positions
    layout = "backbone+dense" if dense else "causal-lm"
    scale = head_logit_scale(config) if dense else 1.0
    if scale is None:
        raise ConfigError(f"this '{config.model_type}' model soft-caps its logits (final_logit_softcapping): its "
                          "sparse encoder cannot carry a term bias; export it without one (splade.term_bias: false)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.export.", dir=out_dir.parent))
    try:
        stage, built = scratch / "stage", scratch / "built"
        tok = prepare_tokenizer(tokenizer, stage, max_seq_length)
        saved = config.pad_token_id
        try:
            if config.pad_token_id is None:
                config.pad_token_id = tok.pad_token_id
            lm.save_pretrained(stage)
        finally:
            config.pad_token_id = saved
        head = _dense_head(lm.get_output_embeddings(), scale, term_bias) if dense else None
        _build(stage, built, head=head, attn=attn, dtype=model_dtype, top_k=top_k, prompts=prompts, vocab=vocab,
               query_idf=query_idf)
        if dense:  # the root holds the backbone only: an untied head goes beside it, for a re-export
            save_lm_head(lm, built)
        report = probe_sparse_folder(built, where=f"sparse export to {out_dir}")
        manifest = {"adapt_export": 1, "kind": SPARSE, "layout": layout, "term_bias": term_bias is not None,
                    "queries": "idf" if query_idf is not None else "encoder",
                    "source": source, "pooling": POOLING,
                    "normalize": False, "top_k": top_k, "dtype": str(model_dtype).removeprefix("torch."),
                    "max_seq_length": max_seq_length, "attn_implementation": attn, "prompts": prompts or {},
                    "card": card or {}, "probe": report.to_dict()}
        publish(built, out_dir, manifest)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out_dir


def _dense_head(head, scale: float, term_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of the Dense layer that computes the causal LM's logits from its last hidden states, plus
    ``term_bias``: the head's own, times the family's logit scale."""
    weight = head.weight.detach().float() * scale
    bias = None if head.bias is None else head.bias.detach().float() * scale
    if term_bias is not None:
        bias = term_bias.clone() if bias is None else bias + term_bias
    return weight, bias


def trained_term_bias(folder, lm) -> torch.Tensor | None:
    """The term bias the sparse export in ``folder`` carries (its Dense bias less the head's own, which ``lm``,
    the causal LM loaded from the folder, has), or None."""
    from safetensors import safe_open

    folder = Path(folder)
    if not read_json(folder / MANIFEST).get("term_bias"):
        return None
    dense = next((path for path, kind in _module_types(folder) if kind.endswith("Dense")), None)
    path = folder / str(dense) / "model.safetensors"
    if dense is None or not path.is_file():
        raise ModelLoadError(f"{folder}: its adapt_export.json says it has a term bias, but it has no Dense layer "
                             "weights (model.safetensors) to read it from; export it again from the run")
    with safe_open(str(path), framework="pt") as f:
        bias = f.get_tensor("linear.bias").float()
    head = lm.get_output_embeddings()
    return bias if head.bias is None else bias - head.bias.detach().float() * (head_logit_scale(lm.config) or 1.0)


def _build(stage: Path, built: Path, *, head, attn: str, dtype, top_k, prompts, vocab: int,
           query_idf: torch.Tensor | None = None) -> None:
    """Assemble the SparseEncoder's modules from the staged causal LM and save them to ``built``."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Dense, Router, Transformer
    from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding, SpladePooling

    kwargs = {"attn_implementation": attn, "dtype": dtype}
    if head is None:  # the causal LM itself, every position's logits
        modules = [Transformer(str(stage), transformer_task="text-generation", model_kwargs=kwargs,
                               modality_config=_LOGITS, module_output_name="token_embeddings",
                               processing_kwargs={"text": {"logits_to_keep": 0}})]
    else:  # the backbone, right-padded, then the LM head as a Dense layer over every token
        transformer = Transformer(str(stage), model_kwargs=kwargs, modality_config=_HIDDEN,
                                  module_output_name="token_embeddings")
        weight, bias = head
        dense = Dense(weight.shape[1], vocab, bias=bias is not None, activation_function=None,
                      init_weight=weight.clone(), init_bias=None if bias is None else bias.clone(),
                      module_input_name="token_embeddings")
        modules = [transformer, dense.to(dtype)]
    modules.append(SpladePooling(pooling_strategy="max", activation_function="relu", embedding_dimension=vocab))
    if query_idf is not None:
        from transformers import AutoTokenizer

        idf = SparseStaticEmbedding(AutoTokenizer.from_pretrained(str(stage)), weight=query_idf.clone(), frozen=True)
        modules = [Router.for_query_document(query_modules=[idf], document_modules=modules)]
    encoder = SparseEncoder(modules=modules, prompts=dict(prompts or {}), similarity_fn_name="dot",
                            max_active_dims=top_k, device="cpu")
    encoder.save(str(built), create_model_card=False)
    if query_idf is not None:
        _document_transformer_to_root(built)
    pin_attention(built, attn)
    if attn != "sdpa":  # as adapt.export.dense: sentence-transformers passes model_kwargs to from_pretrained on load
        path = built / Transformer.config_file_name
        st_config = json.loads(path.read_text(encoding="utf-8"))
        st_config["model_kwargs"] = {"attn_implementation": attn}
        path.write_text(json.dumps(st_config, indent=4) + "\n", encoding="utf-8")


def _document_transformer_to_root(built: Path) -> None:
    """Move the router's document Transformer (the causal LM) from its module folder to the root and point the
    router there ("" is the folder itself), so the root is the model folder it is without a router."""
    path = built / ROUTER_CONFIG
    config = json.loads(path.read_text(encoding="utf-8"))
    name = config["structure"]["document"][0]
    for item in (built / name).iterdir():
        if (built / item.name).exists():  # sentence-transformers wrote a root file of the same name: keep both
            raise ModelLoadError(f"cannot move the document model's {item.name} to the export's root: the router "
                                 "already wrote one there (a sentence-transformers version adapt does not know)")
        item.rename(built / item.name)
    (built / name).rmdir()
    config["types"] = {("" if k == name else k): v for k, v in config["types"].items()}
    config["structure"] = {route: ["" if m == name else m for m in ids] for route, ids in config["structure"].items()}
    path.write_text(json.dumps(config, indent=4) + "\n", encoding="utf-8")


def _module_types(folder: Path) -> list[tuple[str, str]]:
    """(path, type) of every module of the SparseEncoder in ``folder``, a router's route modules included."""
    modules = json.loads((folder / "modules.json").read_text(encoding="utf-8"))
    found = [(str(m.get("path", "")), str(m.get("type", ""))) for m in modules]
    if (folder / ROUTER_CONFIG).is_file():
        found += list(json.loads((folder / ROUTER_CONFIG).read_text(encoding="utf-8"))["types"].items())
    return found


def _router(encoder):
    from sentence_transformers.base.modules import Router

    return encoder[0] if isinstance(encoder[0], Router) else None


def document_model(encoder):
    """The transformers model a SparseEncoder runs on documents (behind a router, its document route's)."""
    router = _router(encoder)
    return (router.sub_modules["document"][0] if router is not None else encoder[0]).model


def trained_query_idf(folder) -> torch.Tensor | None:
    """The inference-free queries' IDF weights of the sparse export in ``folder`` (its router's query module), or
    None when its queries go through the model."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / ROUTER_CONFIG).is_file():
        return None
    name = next((path for path, kind in _module_types(folder) if kind.endswith("SparseStaticEmbedding")), None)
    path = folder / str(name) / "model.safetensors"
    if name is None or not path.is_file():
        raise ModelLoadError(f"{folder}: its router has no IDF query module weights ({path}); export it again "
                             "from the run")
    return load_file(str(path))["weight"].float()


def probe_sparse_folder(folder, *, where: str = ""):
    """Load ``folder`` with plain ``SparseEncoder`` (fp32), probe its model for bidirectionality, and check that a
    text gets the same vector alone and padded in a batch. Returns the probe's report."""
    from sentence_transformers import SparseEncoder

    try:
        encoder = SparseEncoder(str(folder), device="cpu", model_kwargs={"dtype": torch.float32})
    except Exception as err:  # noqa: BLE001 - any load failure means the export is unusable
        raise ModelLoadError(f"{where or folder}: sentence-transformers cannot load the sparse export: {err}") from err
    report = assert_bidirectional(document_model(encoder), where=where)
    flags = dict(convert_to_tensor=True, convert_to_sparse_tensor=False, show_progress_bar=False)
    together = encoder.encode(list(_PADDING_TEXTS), **flags)
    alone = torch.stack([encoder.encode([t], **flags)[0] for t in _PADDING_TEXTS])
    change = float((together - alone).abs().max() / alone.abs().max().clamp(min=1e-6))
    if change > 1e-3:
        raise ModelLoadError(f"{where or folder}: the '{report.family}' sparse encoder gives a text another vector when "
                             f"it is padded in a batch (relative change {change:.2g}); sentence-transformers cannot "
                             "run this family's head as exported. Add its facts to adapt/model/families.py (absolute_positions "
                             "if it has learned positions)")
    return report


def reexport_sparse(source, out_dir, *, top_k=None, max_seq_length=None, prompts=None, dtype=None, card=None,
                    origin: str | None = None) -> Path:
    """Export the causal LM in folder ``source`` (a converted run, a sparse export, a staged run's OUT) as a sparse
    encoder, with its trained head (:func:`adapt.model.lm_head.find_lm_head`). Settings left None come from the source's
    previous export (``adapt_export.json``; a dense export's pooling and normalization do not apply); ``card``
    adds to its model card, ``origin`` replaces the decoder it names as converted from."""
    source = Path(source)
    previous = read_json(source / MANIFEST)
    was_sparse = previous.get("kind") == SPARSE
    model, tokenizer = load_decoder(ModelConfig(source=str(source), dtype=previous.get("dtype") or "auto"),
                                    bidirectional=False, require_head=True)
    if not is_bidirectional(model):
        raise NotBidirectionalError(f"{source} is a causal '{model.config.model_type}' model (config.is_causal is not "
                                    "False): convert it with `adapt convert` before exporting it")
    term_bias = trained_term_bias(source, model) if was_sparse else None
    query_idf = trained_query_idf(source) if was_sparse else None
    return export_sparse(model, tokenizer, out_dir, term_bias=term_bias, query_idf=query_idf,
                         top_k=top_k if top_k is not None else (previous.get("top_k") if was_sparse else None),
                         max_seq_length=max_seq_length or previous.get("max_seq_length") or 512,
                         prompts=previous.get("prompts") if prompts is None else prompts,
                         dtype=dtype if dtype is not None else previous.get("dtype"),
                         card={**previous.get("card", {}), **(card or {})},
                         source=origin or previous.get("source") or str(source))
