"""Run configuration: dataclasses that explain themselves, YAML presets in, resolved YAML out.

A run is ``RunConfig(model, data, objective, tuning, train, export, contrastive, splade)``, plus an optional
``stages`` list that chains runs (``adapt.pipeline.chain``). Presets under ``presets/`` are partial dicts of
the same shape; ``--set section.key=value`` overrides any field. Every value is
checked in ``__post_init__`` so a bad preset fails before any model is loaded.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

import yaml

from adapt.config.values import coerce
from adapt.errors import ConfigError
from adapt.config.preset_files import PRESETS_DIR, accelerate_configs, list_presets, load_preset, preset_path  # noqa: F401


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _help(text: str, default=dataclasses.MISSING, default_factory=dataclasses.MISSING):
    kw = {"metadata": {"help": text}}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, **kw)
    return field(default=default, **kw)


@dataclass
class ModelConfig:
    source: str = _help("decoder to convert: a local folder, a hub id, a .gguf file, or py:PACKAGE "
                        "(the folder of an installed Python package that ships a model)", "")
    gguf_file: str | None = _help("GGUF file name inside `source` when it is a folder", None)
    dtype: str = _help("weights dtype: auto (as stored), float32, bfloat16, float16", "auto")
    attn_implementation: str | None = _help("sdpa, eager, flash_attention_2, flex_attention; "
                                            "default: the family's preferred one from adapt/model/families.py", None)
    sliding_window: str = _help("full: local layers become full attention; keep: keep the window", "full")
    mask_token: str = _help("auto | tokenizer | reserved | add | underscore | eos | a literal token", "auto")
    trust_remote_code: bool = _help("allow code from the model repository (off unless asked)", False)
    allow_pickle: bool = _help("allow loading pickle (.bin) weights; safetensors only otherwise", False)
    revision: str | None = _help("hub revision (branch, tag or commit)", None)

    def __post_init__(self):
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"),
               f"model.dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}")
        _check(self.sliding_window in ("full", "keep"), "model.sliding_window must be 'full' or 'keep'")
        _check(isinstance(self.mask_token, str) and self.mask_token != "", "model.mask_token must be a non-empty string")


@dataclass
class DataConfig:
    sources: list[str] = _help("text files, jsonl, parquet, folders of these, or hf:NAME[:CONFIG]",
                               default_factory=list)
    text_field: str = _help("field/column holding the text in jsonl and parquet", "text")
    seq_len: int = _help("tokens per packed training sequence", 128)
    eval_fraction: float = _help("fraction of packed blocks held out for eval loss and accuracy", 0.05)
    max_tokens: int | None = _help("stop reading the corpus after this many tokens", None)

    def __post_init__(self):
        if isinstance(self.sources, str):
            self.sources = [self.sources]
        _check(self.seq_len >= 8, "data.seq_len must be at least 8")
        _check(0 < self.eval_fraction < 0.5, "data.eval_fraction must be in (0, 0.5)")


@dataclass
class ObjectiveConfig:
    schedule: Any = _help("mlm | mntp | clm, a mixture {mlm: 0.75, clm: 0.25}, or phases "
                          "[{objective: clm, until: 0.5}, {objective: mlm, until: 1.0}]", "mlm")
    mask_ratio: float = _help("fraction of tokens masked (20 to 50 percent are the useful range)", 0.3)
    replacement: str = _help("80-10-10 (mask / random / keep) or mask (all mask token)", "80-10-10")

    def __post_init__(self):
        _check(0.0 < self.mask_ratio < 1.0, f"objective.mask_ratio must be in (0, 1), not {self.mask_ratio}")
        _check(self.replacement in ("80-10-10", "mask"), "objective.replacement must be '80-10-10' or 'mask'")
        from adapt.config.schedule import ObjectiveSchedule

        try:
            ObjectiveSchedule(self.schedule)
        except (ValueError, TypeError, ConfigError) as e:
            raise ConfigError(f"objective.schedule: {e}") from None


@dataclass
class TuningConfig:
    method: str = _help("full | lora | qlora", "full")
    lora_r: int = _help("LoRA rank", 16)
    lora_alpha: int = _help("LoRA alpha", 32)
    lora_dropout: float = _help("LoRA dropout", 0.05)
    target_modules: Any = _help("registry (the family's facts; attention for mixture-of-experts), attention, "
                                "all-linear, or a list of module names", "registry")
    quant_bits: int = _help("qlora: 4 or 8", 4)
    quant_type: str = _help("qlora 4-bit type: nf4 or fp4", "nf4")
    double_quant: bool = _help("qlora: double quantization", True)
    gradient_checkpointing: bool = _help("trade compute for memory", False)
    kbit_fp32: str = _help("qlora: frozen weights that are not quantized going to fp32 - auto: norms if the model "
                           "is loaded in float16, else none | none: all stay as loaded (bf16 has fp32's range) | "
                           "norms: only 1-D ones (norms, biases) | all: every one, as peft's "
                           "prepare_model_for_kbit_training does (embeddings and a tied head doubled)", "auto")
    cpu_malloc: str = _help("training on the CPU: lean: glibc's mmap threshold fixed at 128 KiB, so freed large "
                            "blocks go back to the OS (less peak memory, some step time) | glibc: as it comes | "
                            "auto: lean for qlora, glibc otherwise", "auto")

    def __post_init__(self):
        _check(self.method in ("full", "lora", "qlora"), f"tuning.method must be full, lora or qlora, not {self.method!r}")
        _check(self.kbit_fp32 in ("auto", "none", "norms", "all"),
               f"tuning.kbit_fp32 must be auto, none, norms or all, not {self.kbit_fp32!r}")
        _check(self.cpu_malloc in ("auto", "lean", "glibc"),
               f"tuning.cpu_malloc must be auto, lean or glibc, not {self.cpu_malloc!r}")
        _check(self.lora_r > 0 and self.lora_alpha > 0, "tuning.lora_r and lora_alpha must be positive")
        _check(0 <= self.lora_dropout < 1, "tuning.lora_dropout must be in [0, 1)")
        _check(self.quant_bits in (4, 8), "tuning.quant_bits must be 4 or 8")
        _check(self.quant_type in ("nf4", "fp4"), "tuning.quant_type must be nf4 or fp4")


@dataclass
class TrainConfig:
    max_steps: int = _help("optimizer steps", 100)
    batch_size: int = _help("sequences per micro-batch per process", 8)
    grad_accum: int = _help("micro-batches per optimizer step", 1)
    lr: float = _help("peak learning rate", 5e-5)
    weight_decay: float = _help("AdamW weight decay", 0.01)
    warmup_ratio: float = _help("fraction of steps of linear warmup", 0.05)
    scheduler: str = _help("cosine | linear | constant (after warmup)", "cosine")
    max_grad_norm: float = _help("gradient clipping norm (0 disables)", 1.0)
    mixed_precision: str = _help("no | bf16 | fp16 (Accelerate autocast)", "no")
    eval_every: int = _help("evaluate every N steps (0: only at the end)", 50)
    eval_batches: int = _help("held-out batches per evaluation", 8)
    save_every: int = _help("checkpoint every N steps (0: only at the end)", 50)
    keep_checkpoints: int = _help("checkpoints kept on disk", 2)
    log_every: int = _help("metrics log interval in steps", 10)
    seed: int = _help("seed for data order, masking and init", 0)
    trackers: list[str] = _help("Accelerate trackers: tensorboard, wandb (used when installed)", default_factory=list)
    best_metric: str | None = _help("keep the weights of the evaluation where this eval metric was best (e.g. "
                                    "eval/macro_f1; a name ending in _loss is minimised, others maximised); null: "
                                    "the last weights. Kept in memory: a resumed run tracks the best from where it "
                                    "resumed", None)
    patience: int = _help("with best_metric: stop after this many evaluations without improvement (0: never)", 0)

    def __post_init__(self):
        _check(self.max_steps > 0, "train.max_steps must be positive")
        _check(self.batch_size > 0 and self.grad_accum > 0, "train.batch_size and grad_accum must be positive")
        _check(self.lr > 0, "train.lr must be positive")
        _check(0 <= self.warmup_ratio < 1, "train.warmup_ratio must be in [0, 1)")
        _check(self.scheduler in ("cosine", "linear", "constant"), "train.scheduler must be cosine, linear or constant")
        _check(self.mixed_precision in ("no", "bf16", "fp16"), "train.mixed_precision must be no, bf16 or fp16")
        _check(self.keep_checkpoints >= 1, "train.keep_checkpoints must be at least 1")
        _check(self.patience >= 0, "train.patience must be 0 (off) or a positive number of evaluations")
        _check(self.best_metric is None or isinstance(self.best_metric, str),
               "train.best_metric must be the name of an eval metric, like eval/mlm_loss")


@dataclass
class ExportConfig:
    pooling: str = _help("mean | weightedmean | lasttoken | cls", "mean")
    normalize: bool = _help("L2-normalize embeddings", False)
    max_seq_length: int = _help("encoder max sequence length", 512)
    prompts: dict = _help("prompts by name, e.g. {query: 'query: '}", default_factory=dict)
    sink_prompt: str = _help("text put before every text (in training too) and left out of pooling, with the "
                             "prompts: the first position of a decoder is an attention sink, and with no BOS token "
                             "a text's first word is lost to it (adapt.model.pooling). '\\n' | '' (none)", "")
    dtype: str | None = _help("saved dtype: float32, bfloat16, float16 (default: as trained)", None)
    order_dims: str = _help("pca: turn the pooled vector onto the principal axes of the stage's training text "
                            "(an orthogonal Dense layer: full-size similarities unchanged), so its first N "
                            "dimensions are the best N to truncate to (adapt.export.dim_order) | none", "none")
    order_texts: int = _help("order_dims: at most this many training texts (spans of <= 32 words) to fit on", 4096)

    def __post_init__(self):
        _check(self.pooling in ("mean", "weightedmean", "lasttoken", "cls"),
               f"export.pooling must be mean, weightedmean, lasttoken or cls, not {self.pooling!r}")
        _check(isinstance(self.sink_prompt, str), f"export.sink_prompt must be a string, not {self.sink_prompt!r}")
        _check(self.order_dims in ("none", "pca"), f"export.order_dims must be none or pca, not {self.order_dims!r}")
        _check(isinstance(self.order_texts, int) and self.order_texts >= 2,
               f"export.order_texts must be a whole number of texts, 2 or more, not {self.order_texts!r}")
        _check(self.dtype in (None, "float32", "bfloat16", "float16"), "export.dtype must be float32, bfloat16 or float16")


CONTRASTIVE_LOSSES = ("simcse", "pairs", "crops")


@dataclass
class ContrastiveConfig:
    """A contrastive stage (``adapt.contrastive``). Steps, batch size, lr, schedule, precision and
    checkpoints come from the stage's ``train`` section; pooling from ``export.pooling``."""
    loss: str = _help("simcse: two dropout views of each text of data.sources are positives, in-batch "
                      "negatives | pairs: supervised {query, positive, negatives} lines of `pairs` | crops: two "
                      "spans cut independently from each document of data.sources are positives (Contriever)",
                      "simcse")
    pairs: str | None = _help("pairs: a JSON-lines file of {query, positive, negatives?: [...]}", None)
    temperature: float = _help("softmax temperature on cosine similarities (sentence-transformers' scale = "
                               "1 / temperature; 0.05 is scale 20)", 0.05)
    dropout: float | None = _help("dropout set on the decoder's attention/hidden dropouts for this stage (decoders "
                                  "often ship 0; SimCSE needs some); null: 0.1 for simcse, as the model has for pairs",
                                  None)
    max_length: int = _help("tokens per text while training (prompt included)", 128)
    mini_batch: Any = _help("gradient caching: texts per forward chunk, so a batch larger than memory trains "
                            "exactly as if embedded at once (0: no caching; with train.grad_accum > 1 it "
                            "defaults to train.batch_size) | auto: chosen when the stage starts from the model's "
                            "shape, max_length and the memory free on the device, no caching where the whole "
                            "step fits (recorded in the run's summary)", 0)
    hard_negatives: int = _help("pairs: at most this many of a line's negatives go into each batch", 1)
    query_prompt: str = _help("pairs: text put before each query (also exported as the prompt 'query')", "")
    document_prompt: str = _help("pairs: text put before positives and negatives (exported as 'document')", "")
    gather: bool = _help("with several processes, every process's documents are negatives for every query", True)
    min_words: int = _help("simcse: sentences of fewer words are skipped", 4)
    max_texts: int | None = _help("simcse: use at most this many sentences (pairs: lines; crops: documents) of the "
                                  "data", None)
    crop_ratio: list = _help("crops: each span is this fraction of its document's words, drawn uniformly "
                             "between the two bounds (Contriever: 0.1 to 0.5)", default_factory=lambda: [0.1, 0.5])
    query_words: list = _help("crops: the query span's length in words, drawn uniformly between the two bounds, "
                              "e.g. [1, 16]: short queries against document spans, as search queries are; [] the "
                              "query is cut like the document (crop_ratio)", default_factory=list)
    query_in_document: float = _help("crops: the share of queries cut from inside their own document span, so the "
                                     "pair shares words (the exact-term matching BM25 does; ICT keeps 10%)", 0.0)
    matryoshka_dims: list = _help("Matryoshka: also train the first N dimensions of the pooled vector, each prefix "
                                  "re-normalized, for every N listed ('full': the model's hidden size), so the "
                                  "encoder serves truncated vectors, e.g. [full, 256, 128, 64]; [] off",
                                  default_factory=list)
    matryoshka_weights: list = _help("Matryoshka: the loss weight of each of matryoshka_dims (same order); [] all 1",
                                     default_factory=list)
    keep_source: float = _help("weight of a term that keeps what the stage's source holds: 1 - linear CKA between the "
                               "batch's pooled vectors and the source's (its starting weights, with the attention it "
                               "had: a causal decoder's stays causal), each dimension standardized, so what a linear "
                               "probe read from the source stays readable; 0 off. Costs one forward of the source "
                               "per step (LoRA: the adapters switched off; full: a frozen copy)", 0.0)

    def __post_init__(self):
        _check(self.loss in CONTRASTIVE_LOSSES,
               f"contrastive.loss must be {', '.join(CONTRASTIVE_LOSSES)}, not {self.loss!r}")
        _check(isinstance(self.temperature, (int, float)) and 0 < self.temperature <= 10,
               f"contrastive.temperature must be in (0, 10], not {self.temperature!r}")
        _check(self.dropout is None or 0 <= self.dropout < 1, "contrastive.dropout must be in [0, 1) or null")
        _check(self.max_length >= 4, "contrastive.max_length must be at least 4")
        _check(self.mini_batch == "auto" or type(self.mini_batch) is int and self.mini_batch >= 0,
               f"contrastive.mini_batch must be 0 (off), a positive number of texts or auto, not {self.mini_batch!r}")
        _check(self.hard_negatives >= 0, "contrastive.hard_negatives must be 0 or more")
        _check(self.min_words >= 1, "contrastive.min_words must be at least 1")
        _check(self.max_texts is None or self.max_texts > 0, "contrastive.max_texts must be positive or null")
        _check(isinstance(self.crop_ratio, (list, tuple)) and len(self.crop_ratio) == 2
               and 0 < self.crop_ratio[0] <= self.crop_ratio[1] <= 1,
               f"contrastive.crop_ratio must be [low, high] with 0 < low <= high <= 1, not {self.crop_ratio!r}")
        self.crop_ratio = [float(x) for x in self.crop_ratio]
        q = self.query_words
        _check(isinstance(q, (list, tuple))
               and (not q or len(q) == 2 and all(type(x) is int for x in q) and 1 <= q[0] <= q[1]),
               f"contrastive.query_words must be [] or [low, high] words with 1 <= low <= high, not {q!r}")
        _check(isinstance(self.query_in_document, (int, float)) and 0 <= self.query_in_document <= 1,
               f"contrastive.query_in_document must be a share in [0, 1], not {self.query_in_document!r}")
        _check(isinstance(self.keep_source, (int, float)) and not isinstance(self.keep_source, bool)
               and 0 <= self.keep_source <= 100,
               f"contrastive.keep_source must be a weight in [0, 100] (0: off), not {self.keep_source!r}")
        _check(isinstance(self.query_prompt, str) and isinstance(self.document_prompt, str),
               "contrastive.query_prompt and document_prompt must be strings")
        check_matryoshka(self.matryoshka_dims, self.matryoshka_weights)


def check_matryoshka(dims, weights) -> None:
    """The shape of ``contrastive.matryoshka_dims`` / ``matryoshka_weights`` (the sizes are checked against the
    model's hidden size when it is known: ``adapt.objectives.infonce.matryoshka_sizes``)."""
    key = "contrastive.matryoshka_dims"
    _check(isinstance(dims, (list, tuple)), f"{key} must be a list like [full, 256, 64], not {dims!r}")
    for d in dims:
        _check(d == "full" or isinstance(d, int) and not isinstance(d, bool) and d > 0,
               f"{key}: {d!r} is neither a positive number of dimensions nor 'full' (the model's hidden size)")
    _check(len(set(dims)) == len(dims), f"{key} lists a size twice: {list(dims)}")
    _check(isinstance(weights, (list, tuple)) and (not weights or len(weights) == len(dims)),
           f"contrastive.matryoshka_weights must be [] or one weight per size of {key} ({len(dims)}), not {weights!r}")
    _check(all(isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0 for w in weights),
           f"contrastive.matryoshka_weights must be positive numbers, not {weights!r}")


@dataclass
class SpladeConfig:
    """A ``splade`` stage (``adapt.objectives.splade``): the MLM head's vocabulary logits pooled into one weight
    per term (max over tokens of log1p(relu)), trained on ranking pairs. Its pairs (``contrastive.pairs``, else
    crops of ``data.sources``) and their settings (hard_negatives, crop_ratio, max_length, mini_batch, gather,
    max_texts, prompts) come from the ``contrastive`` section."""
    lambda_q: float = _help("FLOPS regularizer weight on query vectors (SPLADE v2: 3e-4); larger: fewer active "
                            "terms per query", 3e-4)
    lambda_d: float = _help("FLOPS regularizer weight on document vectors (SPLADE v2: 1e-4)", 1e-4)
    lambda_warmup: float = _help("fraction of the stage's steps over which both weights grow quadratically from 0 "
                                 "(SPLADE v2: 50k of 150k steps)", 0.33)
    top_k: int | None = _help("keep only the k largest weights of each vector in the exported encoder "
                              "(sentence-transformers' max_active_dims); null: all", None)
    term_bias: bool = _help("learn one bias per vocabulary term, added to the head's logits before relu: a "
                            "decoder's LM head has none, and its logits are mostly positive, so without it nearly "
                            "every term is active in every text (measured: 48k of 49k on SmolLM2)", True)
    queries: str = _help("encoder: queries go through the model like documents; idf: inference-free queries, "
                         "each token's BM25 IDF over the training documents, no model run (sentence-transformers' "
                         "SparseStaticEmbedding behind a Router, as OpenSearch's inference-free encoders): only "
                         "documents are encoded by the model, at training and at search time", "encoder")
    own_terms: float = _help("weight of a loss that keeps each training document's own tokens active: the "
                             "IDF-weighted mean over its tokens of relu(1 - z), z the token's pooled logit plus its "
                             "bias (what relu cuts), so each gets a weight of at least log(2); unlike the ranking "
                             "losses it reaches tokens whose weight is 0 (0: off)", 0.0)
    init_active_terms: int = _help("the term bias starts at minus each term's mean pooled logit over a calibration "
                                   "batch of the training texts, shifted so that a text has about this many active "
                                   "terms; training (and FLOPS) moves it from there", 256)

    def __post_init__(self):
        _check(self.queries in ("encoder", "idf"), f"splade.queries must be 'encoder' or 'idf', not {self.queries!r}")
        _check(self.init_active_terms > 0, f"splade.init_active_terms must be a positive number of terms, not "
               f"{self.init_active_terms!r}")
        _check(self.own_terms >= 0, f"splade.own_terms must be 0 (off) or a positive loss weight, not "
               f"{self.own_terms!r}")
        _check(self.lambda_q >= 0 and self.lambda_d >= 0, "splade.lambda_q and splade.lambda_d must be 0 or more")
        _check(0 <= self.lambda_warmup <= 1, f"splade.lambda_warmup must be in [0, 1], not {self.lambda_warmup}")
        _check(self.top_k is None or self.top_k > 0, "splade.top_k must be a positive number of terms or null")


SECTIONS = {"model": ModelConfig, "data": DataConfig, "objective": ObjectiveConfig, "tuning": TuningConfig,
            "train": TrainConfig, "export": ExportConfig, "contrastive": ContrastiveConfig, "splade": SpladeConfig}


def check_stages(stages) -> list:
    """A preset's ``stages``: a list of kinds, or of ``{kind: KIND, SECTION: {overrides}}`` mappings.

    Only the shape is checked here; :mod:`adapt.pipeline.chain` checks each kind against the objectives."""
    _check(isinstance(stages, list), f"stages must be a list like [mntp, simcse], not {stages!r}")
    for i, stage in enumerate(stages, 1):
        kind = stage.get("kind") if isinstance(stage, dict) else stage
        _check(isinstance(kind, str) and kind != "", f"stage {i}: expected a kind such as mlm or simcse, not {kind!r}")
        if isinstance(stage, dict):
            bad = set(stage) - {"kind"} - set(SECTIONS)
            _check(not bad, f"stage {i} ({kind}): unknown key(s) {sorted(bad)}; a stage holds `kind` and "
                            f"section overrides ({', '.join(SECTIONS)})")
            for name in set(stage) - {"kind"}:
                _check(isinstance(stage[name], dict), f"stage {i} ({kind}): {name} must be a mapping")
                known = {f.name for f in fields(SECTIONS[name])}
                bad = set(stage[name]) - known
                _check(not bad, f"stage {i} ({kind}): unknown key(s) {sorted(bad)} in section {name!r}; "
                                f"known: {sorted(known)}")
    return stages


DEFAULT_KIND = "mlm"
DEFAULT_PRESET = "default"  # the recipe `adapt convert` runs when given no preset (benchmarks/studies/recipe_study.py chose it)
_LEGACY_KINDS = {"simcse": "simcse", "pairs": "contrastive"}  # contrastive.loss of runs saved before `kind`


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    tuning: TuningConfig = field(default_factory=TuningConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    contrastive: ContrastiveConfig = field(default_factory=ContrastiveConfig)
    splade: SpladeConfig = field(default_factory=SpladeConfig)
    description: str = ""
    stages: list = field(default_factory=list)  # see check_stages and adapt.pipeline.chain
    kind: str = DEFAULT_KIND  # what the run trains: an objective kind of adapt.objectives (mlm, mntp, simcse, ...)

    @classmethod
    def from_dict(cls, raw: dict) -> "RunConfig":
        raw = dict(raw or {})
        description = raw.pop("description", "") or ""
        stages = check_stages(raw.pop("stages", None) or [])
        kind = raw.pop("kind", None)
        if kind is None:  # a config.yaml written before runs named their kind
            loss = (raw.get("contrastive") or {}).get("loss", "simcse") if "contrastive" in raw else None
            kind = _LEGACY_KINDS.get(loss, DEFAULT_KIND)
        _check(isinstance(kind, str) and kind != "", f"kind must be an objective kind such as mlm, not {kind!r}")
        unknown = set(raw) - set(SECTIONS)
        _check(not unknown, f"unknown config section(s) {sorted(unknown)}; known: {sorted(SECTIONS)}")
        parts = {}
        for name, klass in SECTIONS.items():
            values = raw.get(name) or {}
            _check(isinstance(values, dict), f"config section {name!r} must be a mapping")
            types = {f.name: f.type for f in fields(klass)}
            bad = set(values) - set(types)
            _check(not bad, f"unknown key(s) {sorted(bad)} in section {name!r}; known: {sorted(types)}")
            values = {k: coerce(f"{name}.{k}", types[k], v, from_text=False) for k, v in values.items()}
            try:
                parts[name] = klass(**values)
            except TypeError as e:
                raise ConfigError(f"section {name!r}: {e}") from None
        return cls(**parts, description=description, stages=stages, kind=kind)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for key, default in (("description", ""), ("stages", []), ("kind", DEFAULT_KIND),
                             ("contrastive", dataclasses.asdict(ContrastiveConfig())),
                             ("splade", dataclasses.asdict(SpladeConfig()))):
            if out[key] == default:  # MLM-only runs keep the config.yaml they always had
                out.pop(key)
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``section.key=value`` overrides to a raw config dict, each value read as its field's type
    (:mod:`adapt.config.values`: ``no`` stays text for a text field, ``1e-4`` is a number, ``null`` empties an
    optional field)."""
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (raw or {}).items()}
    for item in overrides:
        key, sep, value = item.partition("=")
        _check(bool(sep) and "." in key, f"--set expects section.key=value, got {item!r}")
        section, _, name = key.partition(".")
        _check(section in SECTIONS, f"--set {item!r}: unknown section {section!r}; known: {sorted(SECTIONS)}")
        types = {f.name: f.type for f in fields(SECTIONS[section])}
        _check(name in types, f"--set {item!r}: unknown key {name!r} in section {section!r}; known: {sorted(types)}")
        raw.setdefault(section, {})
        raw[section] = dict(raw[section] or {})
        raw[section][name] = coerce(key, types[name], value, from_text=True)
    return raw


def build_config(preset: str | None = None, overrides: list[str] = (), **explicit) -> RunConfig:
    """Preset, then explicit arguments (``section__key=value``, None skipped), then ``--set`` overrides."""
    raw = load_preset(preset) if preset else {}
    for key, value in explicit.items():
        if value is None:
            continue
        section, _, name = key.partition("__")
        raw[section] = {**(raw.get(section) or {}), name: value}
    raw = apply_overrides(raw, list(overrides))  # --set has the last word
    return RunConfig.from_dict(raw)
