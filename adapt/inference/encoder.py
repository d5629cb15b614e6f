"""Load an encoder and encode text fast: ``load_encoder(source).encode(texts)``.

``source`` is an exported encoder (a sentence-transformers folder: its pooling, normalization,
prompts and length are used unless overridden), a raw decoder folder or hub id (mean pooling by
default; ``bidirectional`` None = as its config says, False = causal, True = made bidirectional
without training) or any sentence-transformers model of Transformer + Pooling [+ linear Dense layers] [+ Normalize].

Vectors equal ``SentenceTransformer(folder).encode`` (same tokenization, truncation, prompts and
pooling), computed faster: texts are tokenized once, sorted by token length, padded per batch on the
right, run under ``torch.inference_mode`` in the chosen dtype, and pooled in fp32.

Defined edge cases (counted, one warning per call): an empty text is embedded as the tokenizer
encodes it (with a prompt: the prompt alone); when that is zero tokens, as a lone EOS token (else
BOS, else pad) - sentence-transformers would pool zero tokens into a zero vector, as both do where the
prompt is left out of pooling (``include_prompt: false``: a sink prompt). A text longer
than ``max_length`` tokens is truncated like the tokenizer truncates (special tokens kept).

``truncate_dim`` keeps the first N dimensions of each vector (an encoder trained with Matryoshka sizes,
``contrastive.matryoshka_dims``), as sentence-transformers' ``truncate_dim`` does; normalization, when
on, applies to the truncated vector (as ``encode(normalize_embeddings=True)`` there).
"""
from __future__ import annotations

import hashlib
import logging
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

from adapt.model.families import facts_for
from adapt.export import backends
from adapt.inference.graph_model import BackendModel, folder_backend
from adapt.inference.model_source import folder_settings, load_model, resolve_encoder_source
from adapt.data.batches import length_batches
from adapt.model.bidirectional import is_bidirectional, make_bidirectional, position_ids_from_mask
from adapt.errors import ConfigError, ModelLoadError
from adapt.export.folder import fingerprint as fingerprint_of, load_projection, projection_key, \
    resolve_max_length
from adapt.model.loading import parse_dtype
from adapt.model.pooling import check_sink, pool, pooling_name, prompt_token_count, sink_prompts

log = logging.getLogger(__name__)


class EncodeWarning(UserWarning):
    """Texts were truncated or empty (the message gives the counts)."""


@dataclass
class EncodeStats:
    n: int = 0
    truncated: int = 0
    empty: int = 0
    tokens: int = 0

    def add(self, other: "EncodeStats") -> None:
        self.n, self.truncated = self.n + other.n, self.truncated + other.truncated
        self.empty, self.tokens = self.empty + other.empty, self.tokens + other.tokens

    def warn(self, max_length: int) -> None:
        if self.truncated:
            warnings.warn(f"{self.truncated} of {self.n} texts were longer than {max_length} tokens and were "
                          "truncated", EncodeWarning, stacklevel=3)
        if self.empty:
            warnings.warn(f"{self.empty} of {self.n} texts were empty; each was embedded as the tokenizer encodes "
                          "an empty text (a lone EOS token when that is no token at all), or as a zero vector where "
                          "the prompt is left out of pooling (a sink prompt)", EncodeWarning, stacklevel=3)


@dataclass
class Encoder:
    """A loaded encoder. ``encode`` returns float32 ``(n, dim)`` vectors in input order."""
    model: torch.nn.Module
    tokenizer: object
    name: str
    pooling: str
    normalize: bool
    max_length: int
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    include_prompt: bool = True
    do_lower_case: bool = False
    fingerprint: str = ""
    last_stats: EncodeStats = field(default_factory=EncodeStats)
    truncate_dim: int | None = None  # keep the first N dimensions (see :func:`truncated`)
    projections: list = field(default_factory=list)  # linear Dense layers after pooling: [(weight, bias|None)]
    identity: dict = field(default_factory=dict, repr=False)  # what the fingerprint hashes (see :func:`variant`)

    def __post_init__(self):
        self.model.eval()
        self.projections = [(w.float(), None if b is None else b.float()) for w, b in self.projections]
        tok = self.tokenizer
        self._pad_id = next((i for i in (tok.pad_token_id, tok.eos_token_id, 0) if i is not None), 0)
        self._filler_id = next((i for i in (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, 0) if i is not None))
        self._absolute = facts_for(self.model.config).absolute_positions
        self._prompt_lengths: dict[str, int] = {}

    @property
    def full_dim(self) -> int:
        """The size of the vectors before any truncation: the hidden size, or the last Dense layer's output."""
        return int(self.projections[-1][0].shape[0]) if self.projections else int(self.model.config.hidden_size)

    @property
    def dim(self) -> int:
        full = self.full_dim
        return min(full, self.truncate_dim) if self.truncate_dim else full

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def resolve_prompt(self, prompt_name: str | None = None, prompt: str | None = None) -> str:
        if prompt is not None:
            return prompt
        prompt_name = prompt_name or self.default_prompt_name
        if prompt_name is None:
            return ""
        if prompt_name not in self.prompts:
            raise ConfigError(f"{self.name} has no prompt named {prompt_name!r}; its prompts: "
                              f"{', '.join(self.prompts) or 'none'}")
        return self.prompts[prompt_name]

    def tokenize(self, texts: list[str], prompt: str = "") -> tuple[list[list[int]], EncodeStats]:
        """Token ids as sentence-transformers makes them (prompt prepended, truncated), and the counts."""
        full = [prompt + (t.lower() if self.do_lower_case else t) for t in texts]
        call = dict(add_special_tokens=True, truncation=True, return_attention_mask=False, verbose=False)
        ids = self.tokenizer(full, max_length=self.max_length + 1, **call)["input_ids"] if full else []
        long = [i for i, row in enumerate(ids) if len(row) > self.max_length]
        if long:  # one token over the limit means the text was cut: redo those with the real limit
            redone = self.tokenizer([full[i] for i in long], max_length=self.max_length, **call)["input_ids"]
            for i, row in zip(long, redone):
                ids[i] = row
        stats = EncodeStats(n=len(texts), truncated=len(long), empty=sum(1 for t in texts if not t))
        for i, row in enumerate(ids):
            if not row:
                ids[i] = [self._filler_id]
        stats.tokens = sum(len(row) for row in ids)
        return ids, stats

    def _prompt_length(self, prompt: str) -> int:
        """Prompt tokens excluded from pooling when the folder says ``include_prompt: false``."""
        if prompt not in self._prompt_lengths:
            self._prompt_lengths[prompt] = prompt_token_count(self.tokenizer, prompt)
        return self._prompt_lengths[prompt]

    @torch.inference_mode()
    def _forward(self, batch: list[list[int]], prompt_length: int, poolings: list[str]) -> list[torch.Tensor]:
        width = max(len(row) for row in batch)
        ids = torch.full((len(batch), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, row in enumerate(batch):
            ids[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row)] = 1
        kwargs = {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}
        if self._absolute:
            kwargs["position_ids"] = position_ids_from_mask(kwargs["attention_mask"])
        hidden = self.model(**kwargs, return_dict=True).last_hidden_state.float()  # (B, T, H)
        out = []
        for pooling in poolings:  # one forward, pooled each way asked
            vectors = pool(hidden, kwargs["attention_mask"], pooling, prompt_length)
            for weight, bias in self.projections:  # the folder's linear Dense layers, in fp32 as pooled
                vectors = torch.nn.functional.linear(vectors, weight.to(vectors.device),
                                                     None if bias is None else bias.to(vectors.device))
            out.append(vectors)
        return out

    def encode(self, texts: Iterable[str] | str, *, batch_size: int = 32, prompt_name: str | None = None,
               prompt: str | None = None, normalize: bool | None = None, show_progress: bool = False,
               max_batch_tokens: int | None = None) -> np.ndarray:
        """Encode ``texts`` into a float32 array of shape ``(len(texts), dim)``, in input order.

        A batch holds up to ``batch_size`` texts of similar length, and fewer when they are long: at most
        ``max_batch_tokens`` padded tokens (default ``batch_size * 128``), so long texts are not padded
        together with short ones and memory stays bounded.
        """
        texts = [texts] if isinstance(texts, str) else list(texts)
        vectors, stats = self._encode(texts, batch_size, self.resolve_prompt(prompt_name, prompt), normalize,
                                      show_progress, max_batch_tokens)
        stats.warn(self.max_length)
        self.last_stats = stats
        return vectors

    def encode_with_stats(self, texts: list[str], *, batch_size: int = 32, prompt_name: str | None = None,
                          prompt: str | None = None, normalize: bool | None = None, max_batch_tokens: int | None = None,
                          on_batch=None) -> tuple[np.ndarray, EncodeStats]:
        """``encode`` without its warnings: the vectors and the counts (texts, tokens, truncated, empty);
        ``on_batch(n)`` is called after each batch of ``n`` texts (a progress bar's ``update``)."""
        return self._encode(list(texts), batch_size, self.resolve_prompt(prompt_name, prompt), normalize, False,
                            max_batch_tokens, on_batch)

    def encode_poolings(self, texts: list[str], poolings: list[str], *, batch_size: int = 32,
                        prompt_name: str | None = None, prompt: str | None = None,
                        normalize: bool | None = None) -> dict[str, np.ndarray]:
        """``encode`` pooled several ways in one pass (pooling name -> vectors): each batch runs the model once,
        so a decoder's mean- and last-token vectors cost one forward (``adapt bench --baselines`` does this)."""
        names = [pooling_name(p) for p in poolings]
        out, stats = self._encode(list(texts), batch_size, self.resolve_prompt(prompt_name, prompt), normalize, False,
                                  poolings=names)
        stats.warn(self.max_length)
        self.last_stats = stats
        return dict(zip(names, out))

    def _encode(self, texts, batch_size, prompt, normalize, show_progress,
                max_batch_tokens=None, on_batch=None, poolings=None):
        """(vectors, stats); with ``poolings``: (one array per pooling, stats)."""
        if batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, not {batch_size}")
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise ConfigError(f"text {bad} is a {type(texts[bad]).__name__}, not a string")
        ids, stats = self.tokenize(texts, prompt)
        outs = [np.empty((len(texts), self.dim), dtype=np.float32) for _ in poolings or [self.pooling]]
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))  # longest first: peak memory up front
        prompt_length = self._prompt_length(prompt) if prompt and not self.include_prompt else 0
        batches = length_batches(order, [len(row) for row in ids], batch_size, max_batch_tokens or batch_size * 128)
        if show_progress:
            from tqdm.auto import tqdm
            batches = tqdm(batches, desc="Encoding", unit="batch")
        for rows in batches:
            for out, vectors in zip(outs, self._forward([ids[i] for i in rows], prompt_length,
                                                        poolings or [self.pooling])):
                vectors = vectors[:, :self.dim]
                if self.normalize if normalize is None else normalize:
                    vectors = torch.nn.functional.normalize(vectors, p=2, dim=-1)
                out[rows] = vectors.cpu().numpy()
            if on_batch is not None:
                on_batch(len(rows))
        return (outs if poolings else outs[0]), stats

    def iter_encode(self, texts: Iterable[str], *, chunk_size: int = 10_000, batch_size: int = 32,
                    prompt_name: str | None = None, prompt: str | None = None, normalize: bool | None = None,
                    show_progress: bool = False, max_batch_tokens: int | None = None,
                    on_batch=None) -> Iterator[np.ndarray]:
        """Encode an iterable of any length chunk by chunk (sorted within a chunk), yielding arrays in
        input order; ``last_stats`` holds the totals (one warning at the end)."""
        prompt_text, total, chunk = self.resolve_prompt(prompt_name, prompt), EncodeStats(), []
        self.last_stats = total
        options = (batch_size, prompt_text, normalize, show_progress, max_batch_tokens, on_batch)
        for text in texts:
            chunk.append(text)
            if len(chunk) >= chunk_size:
                vectors, stats = self._encode(chunk, *options)
                total.add(stats)
                chunk = []
                yield vectors
        if chunk:
            vectors, stats = self._encode(chunk, *options)
            total.add(stats)
            yield vectors
        total.warn(self.max_length)

    def encode_stream(self, texts: Iterable[str], writer, **kwargs) -> EncodeStats:
        """Encode an iterable of any length, calling ``writer.write(vectors)`` chunk by chunk in input order."""
        for vectors in self.iter_encode(texts, **kwargs):
            writer.write(vectors)
        return self.last_stats


def load_encoder(source, *, pooling: str | None = None, bidirectional: bool | None = None,
                 normalize: bool | None = None, dtype="auto", device: str | None = None,
                 max_length: int | None = None, trust_remote_code: bool = False,
                 backend: str | None = None, truncate_dim: int | None = None, sink_prompt: str | None = None) -> Encoder:
    """Load an exported encoder, a sentence-transformers model or a raw decoder (folder or hub id).

    ``dtype``: "auto" is fp32 on CPU and bf16 (else fp16) on a GPU; or bf16/fp16/fp32. ``backend``: None
    runs the graph an exported folder holds (``adapt export --backend onnx|openvino``, see
    :mod:`adapt.inference.graph_model`) and torch otherwise; a name of :mod:`adapt.export.backends` asks for one. Anything
    that is not a loadable model raises :class:`ModelLoadError` saying why. ``truncate_dim``: see
    :func:`truncated`. ``sink_prompt`` (a raw decoder only; an exported encoder keeps what it was trained with):
    put this text before every text and leave it out of pooling, as ``export.sink_prompt`` does
    (:data:`adapt.model.pooling.DEFAULT_SINK`).
    """
    source, gguf_file, path = resolve_encoder_source(source)
    st, model_dir = folder_settings(source, path, gguf_file, sink_prompt)
    graph = _pick_backend(path if st.get("transformer_path") else None, backend)
    if graph is not None:
        return truncated(_load_graph_encoder(path, Path(model_dir), graph, st, pooling=pooling, normalize=normalize,
                                             max_length=max_length, dtype=dtype, device=device), truncate_dim,
                         st.get("matryoshka_dims"))
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch_dtype = parse_dtype(dtype) or (torch.float32 if device.type == "cpu" else
                                         torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    model, tokenizer, config = load_model(source, path, model_dir, gguf_file, st, bidirectional=bidirectional,
                                           torch_dtype=torch_dtype, trust_remote_code=trust_remote_code)
    check_sink(tokenizer, sink_prompt or "", where=f"{source}: sink prompt")
    if bidirectional is True:
        make_bidirectional(model)
    model.to(device)
    max_length = resolve_max_length(max_length, st, tokenizer, config)
    pooling = pooling_name(pooling or st.get("pooling") or "mean")
    normalize = bool(st.get("normalize", False) if normalize is None else normalize)
    name = path.name if path.is_dir() else str(source)
    settings = dict(pooling=pooling, bidirectional=is_bidirectional(model), dtype=str(torch_dtype), normalize=normalize,
                    max_length=int(max_length), prompts=st["prompts"], include_prompt=st["include_prompt"],
                    do_lower_case=st["do_lower_case"], **projection_key(st))
    identity = {"source": path if path.is_dir() else str(source), "model_dir": Path(model_dir), "settings": settings,
                "decoder": "transformer_path" not in st}  # a raw decoder: variant() may pool it another way
    fingerprint = fingerprint_of(identity["source"], identity["model_dir"], **settings)
    return truncated(Encoder(model, tokenizer, name=name, pooling=pooling, normalize=normalize,
                             max_length=int(max_length), prompts=st["prompts"],
                             default_prompt_name=st["default_prompt_name"], include_prompt=st["include_prompt"],
                             do_lower_case=st["do_lower_case"], fingerprint=fingerprint,
                             projections=[load_projection(p) for p in st.get("projections") or []], identity=identity),
                     truncate_dim, st.get("matryoshka_dims"))


def variant(encoder: Encoder, *, pooling: str, sink_prompt: str | None = None) -> Encoder:
    """A raw decoder loaded by :func:`load_encoder`, pooled another way and/or with a sink prompt: the same loaded
    model (no second load), with the settings and fingerprint ``load_encoder(source, pooling=..., sink_prompt=...)``
    gives, so its vectors (and its cache entries) are the same."""
    ident = encoder.identity
    if not ident.get("decoder") or encoder.truncate_dim:
        raise ConfigError(f"{encoder.name}: only a raw decoder loaded whole by load_encoder has variants; load it "
                          "again with the pooling and sink prompt wanted")
    check_sink(encoder.tokenizer, sink_prompt or "", where=f"{encoder.name}: sink prompt")
    prompts, default_name, include = sink_prompts({}, sink_prompt or "")
    settings = {**ident["settings"], "pooling": pooling_name(pooling), "prompts": prompts, "include_prompt": include}
    return replace(encoder, pooling=settings["pooling"], prompts=prompts, default_prompt_name=default_name,
                   include_prompt=include, identity={**ident, "settings": settings}, last_stats=EncodeStats(),
                   fingerprint=fingerprint_of(ident["source"], ident["model_dir"], **settings))


def truncated(encoder: Encoder, dim: int | None, trained: list[int] | None = None) -> Encoder:
    """``encoder`` giving the first ``dim`` dimensions of its vectors (None: all); ``trained``: the sizes its
    folder records (``matryoshka_dims``): another size is allowed, with a warning."""
    if dim is None:
        return encoder
    full = encoder.full_dim
    if isinstance(dim, bool) or not isinstance(dim, int) or not 0 < dim <= full:
        raise ConfigError(f"cannot truncate {encoder.name}'s vectors to {dim!r} dimensions: it has {full}; choose "
                          f"1 to {full}" + (f" (trained sizes: {', '.join(map(str, trained))})" if trained else ""))
    if trained and dim not in trained:
        warnings.warn(f"{encoder.name} was trained for truncation to {', '.join(map(str, trained))} dimensions, not "
                      f"{dim}: its vectors may lose more there", EncodeWarning, stacklevel=2)
    key = hashlib.sha256(f"{encoder.fingerprint}|truncate_dim={dim}".encode()).hexdigest()[:16]
    return replace(encoder, truncate_dim=dim, fingerprint=key, last_stats=EncodeStats())


def _pick_backend(folder: Path | None, backend: str | None) -> dict | None:
    """The graph record to run (see :func:`adapt.inference.graph_model.folder_backend`), or None for torch."""
    backends.check(backend)
    held = folder_backend(folder) if folder is not None else None
    if backend in (None, backends.TORCH) or (held and held["name"] == backend):
        return held if backend is None else (None if backend == backends.TORCH else held)
    raise ModelLoadError(f"{folder} holds no {backend} graph ({'it holds ' + held['name'] if held else 'torch only'}); "
                         f"write one with `adapt export {folder} -o DIR --backend {backend}`")


def _load_graph_encoder(path: Path, model_dir: Path, graph: dict, st: dict, *, pooling, normalize, max_length,
                        dtype, device) -> Encoder:
    """An :class:`Encoder` whose model is the folder's ONNX/OpenVINO graph (fp32 in, fp32 out, on the CPU)."""
    from transformers import AutoConfig, AutoTokenizer

    if dtype not in ("auto", None, "fp32", "float32", torch.float32) or (device or "cpu") != "cpu":
        raise ConfigError(f"{path} runs its {graph['name']} graph on the CPU as it was exported; dtype and device "
                          f"apply to torch: pass backend='{backends.TORCH}' (--backend {backends.TORCH}) to use them")
    try:
        config = AutoConfig.from_pretrained(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = BackendModel(path / graph["file"], graph["name"], config)
    except Exception as err:  # noqa: BLE001 - every failure here is "this is not a model we can load"
        raise ModelLoadError(f"cannot load the {graph['name']} graph of {path}: {type(err).__name__}: {err}") from err
    max_length = resolve_max_length(max_length, st, tokenizer, config)
    pooling = pooling_name(pooling or st.get("pooling") or "mean")
    normalize = bool(st.get("normalize", False) if normalize is None else normalize)
    fingerprint = fingerprint_of(path, path / Path(graph["file"]).parent, pooling=pooling, backend=graph["name"],
                               quantize=graph.get("quantize"), normalize=normalize, max_length=max_length,
                               prompts=st["prompts"], include_prompt=st["include_prompt"],
                               do_lower_case=st["do_lower_case"], **projection_key(st))
    return Encoder(model, tokenizer, name=path.name, pooling=pooling, normalize=normalize, max_length=max_length,
                   prompts=st["prompts"], default_prompt_name=st["default_prompt_name"],
                   include_prompt=st["include_prompt"], do_lower_case=st["do_lower_case"], fingerprint=fingerprint,
                   projections=[load_projection(p) for p in st.get("projections") or []])


def backend_encoder(folder, torch_encoder: Encoder, model) -> Encoder:
    """``torch_encoder``'s settings (pooling, prompts, length...) around another ``model`` (a graph)."""
    return replace(torch_encoder, model=model, name=Path(folder).name, last_stats=EncodeStats())


def backend_of(encoder: Encoder) -> str:
    """The backend an encoder runs (a name of :mod:`adapt.export.backends`)."""
    return getattr(encoder.model, "backend", backends.TORCH)


from adapt.inference.mteb_model import MTEBAdapter  # noqa: E402,F401 - kept importable from here
