"""Re-export a folder as a dense encoder (``adapt export DIR -o OUT``; the ``dense`` entry of
:mod:`adapt.export.kinds`): a converted run, a dense export, or a sparse export's causal LM read as an embedding
encoder. Settings left None are taken from the folder's previous export (``adapt_export.json``), else mean
pooling, no normalization, 512 tokens, no prompts."""
from __future__ import annotations

from pathlib import Path

from adapt.errors import ModelLoadError, NotBidirectionalError
from adapt.export import kinds
from adapt.export.dense import MANIFEST, export_encoder
from adapt.export.dim_order import fitted_order
from adapt.export.folder import previous_rotation
from adapt.files import read_json
from adapt.model.bidirectional import is_bidirectional
from adapt.model.families import preferred_attention


def tokenizer_folder(model_dir: Path) -> Path:
    """The nearest folder at or above ``model_dir`` (up to a run folder's root) with tokenizer files."""
    for folder in [model_dir, *model_dir.parents][:5]:
        if (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file():
            return folder
    raise ModelLoadError(f"no tokenizer found in {model_dir} or the folders above it")


def reexport_dense(model_dir, out_dir, *, pooling=None, normalize=None, max_seq_length=None, prompts=None, dtype=None,
                   card=None, order_dims=None, data=None, origin: str | None = None) -> Path:
    """Export the bidirectional model in ``model_dir`` as a dense encoder at ``out_dir``. ``order_dims``: see
    :func:`adapt.pipeline.reexport.export_from_path` (None: as the previous export); ``origin`` replaces the
    decoder the card names as converted from."""
    model_dir = Path(model_dir)
    previous = read_json(model_dir / MANIFEST)
    if kinds.of_manifest(previous).name != kinds.DENSE:  # a dense encoder of a sparse one: its pooling does not apply
        previous = {k: v for k, v in previous.items() if k not in ("pooling", "normalize")}
    model, tokenizer = _load(model_dir)
    settings = dict(pooling=pooling or previous.get("pooling", "mean"),
                    max_seq_length=max_seq_length or previous.get("max_seq_length") or 512,
                    prompts=previous.get("prompts") if prompts is None else prompts,
                    sink_prompt=previous.get("sink_prompt") or "")
    if order_dims is None:
        rotation = previous_rotation(model_dir, previous, pooling)
        order = previous.get("order_dims") if rotation is not None else None
    else:
        rotation, order = fitted_order(order_dims, data, model, tokenizer, settings, runs_texts=None)
    return export_encoder(
        model, tokenizer, out_dir, **settings,
        normalize=previous.get("normalize", False) if normalize is None else normalize,
        dtype=dtype if dtype is not None else previous.get("dtype"),
        card={**previous.get("card", {}), **(card or {})},
        source=origin or previous.get("source") or str(model_dir), matryoshka_dims=previous.get("matryoshka_dims"),
        rotation=rotation, order=order)


def _load(model_dir: Path):
    """The bidirectional backbone in ``model_dir`` and its tokenizer; a causal model is refused."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as err:  # noqa: BLE001
        raise ModelLoadError(f"{model_dir}: cannot read config.json: {err}") from err
    if not is_bidirectional(config):
        raise NotBidirectionalError(f"{model_dir} is a causal '{config.model_type}' model (config.is_causal is "
                                    "not False): convert it with `adapt convert` before exporting it")
    try:
        model = AutoModel.from_pretrained(model_dir, config=config, attn_implementation=preferred_attention(config))
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder(model_dir))
    except Exception as err:  # noqa: BLE001
        raise ModelLoadError(f"{model_dir}: cannot load the model or tokenizer: {err}") from err
    return model, tokenizer
