"""Pooling token states into one vector, as sentence-transformers' ``Pooling`` module does.

Shared by training (the contrastive objectives pool as the exported encoder will), the fast encoder
and the export, so the three can never disagree.
"""
from __future__ import annotations

import logging

import torch

from adapt.errors import ConfigError

log = logging.getLogger(__name__)

# adapt's pooling names -> sentence-transformers' pooling_mode (and back, with aliases).
POOLINGS = {"mean": "mean", "weightedmean": "weightedmean", "last": "lasttoken", "cls": "cls"}
_ALIASES = {"weighted_mean": "weightedmean", "weighted-mean": "weightedmean", "lasttoken": "last",
            "last_token": "last", "last-token": "last", "first": "cls", "first_token": "cls"}


def pooling_name(pooling: str) -> str:
    """adapt's canonical pooling name for ``pooling`` (also accepts sentence-transformers' mode names)."""
    name = _ALIASES.get(str(pooling).lower(), str(pooling).lower())
    if name not in POOLINGS:
        raise ConfigError(f"unknown pooling {pooling!r}: choose one of {', '.join(POOLINGS)}")
    return name


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str, prompt_length: int | torch.Tensor = 0) -> torch.Tensor:
    """Pool right-padded ``hidden`` (B, T, H) under ``mask`` (B, T) as sentence-transformers' Pooling does.

    ``weightedmean`` weighs position ``t`` by ``t + 1`` (later tokens, which have seen more of the text
    in a causal model, count more); ``last`` takes the last real token; ``cls`` the first.
    ``prompt_length``: leading tokens left out (``include_prompt: false``), one count for all rows or a
    ``(B,)`` tensor of counts, one per row.
    """
    if isinstance(prompt_length, torch.Tensor):
        keep = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0) >= prompt_length.to(mask.device).unsqueeze(1)
        mask = mask * keep.to(mask.dtype)
    elif prompt_length:
        mask = mask.clone()
        mask[:, :prompt_length] = 0
    m = mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    if pooling == "mean":
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    if pooling == "weightedmean":
        w = m * torch.arange(1, hidden.shape[1] + 1, device=hidden.device, dtype=hidden.dtype).view(1, -1, 1)
        return (hidden * w).sum(1) / w.sum(1).clamp(min=1e-9)
    if pooling == "last":
        values, indices = mask.flip(1).max(1)
        last = hidden.shape[1] - 1 - torch.where(values == 0, hidden.shape[1] - 1, indices)
        return (hidden * m)[torch.arange(hidden.shape[0]), last]
    if pooling == "cls":
        return hidden[torch.arange(hidden.shape[0]), mask.to(torch.int).argmax(1)]
    raise ConfigError(f"unknown pooling {pooling!r}: choose one of {', '.join(POOLINGS)}")


# The first position of a causal decoder is an attention sink: every later token attends to it, and it carries
# activations hundreds of times larger than the others and little of its own token's meaning (Xiao et al., 2023,
# "Efficient Streaming Language Models with Attention Sinks"; Sun et al., 2024, "Massive Activations in Large
# Language Models"). A tokenizer that adds a BOS token puts the BOS there; one that does not (SmolLM2, Qwen2,
# GPT-2) gives the text's first word to the sink, and mean pooling then averages in a vector that is not about the
# text. ``export.sink_prompt`` puts this text before every text and leaves it out of pooling.
DEFAULT_SINK = "\n"
SINK_PROMPT_NAME = "default"


def prompt_token_count(tokenizer, prompt: str) -> int:
    """How many leading tokens ``prompt`` takes, counted as sentence-transformers counts them for
    ``include_prompt: false``: the prompt tokenized alone, less a special token the tokenizer appends at its end."""
    ids = tokenizer([prompt], add_special_tokens=True)["input_ids"][0]
    return len(ids) - (1 if ids and ids[-1] in tokenizer.all_special_ids else 0)


def sink_prompts(prompts: dict | None, sink: str) -> tuple[dict, str | None, bool]:
    """``(prompts, default_prompt_name, include_prompt)`` of an encoder exported with ``sink`` (``''``: none):
    each named prompt gets the sink in front, a prompt named ``default`` (the one used when none is asked
    for) is the sink alone, and every prompt is left out of pooling. ``query`` and ``document`` are always
    named (the sink alone unless given): sentence-transformers' ``encode_query`` / ``encode_document`` ask for
    them by name and would otherwise embed the text with no sink."""
    prompts = dict(prompts or {})
    if not sink:
        return prompts, None, True
    if SINK_PROMPT_NAME in prompts:
        raise ConfigError(f"a prompt named {SINK_PROMPT_NAME!r} is what export.sink_prompt adds: rename yours")
    named = {"query": "", "document": "", **prompts, SINK_PROMPT_NAME: ""}
    return {name: sink + text for name, text in named.items()}, SINK_PROMPT_NAME, False


def check_sink(tokenizer, sink: str, where: str = "export.sink_prompt", prompts: dict | None = None) -> None:
    """A sink prompt must take at least one token that pooling leaves out (a special token at its end does not
    count, as sentence-transformers counts prompts). With a sink every prompt is left out of pooling, counted
    alone; a prompt whose last token merges with the text's first (``"query: "``: a lone space token alone, one
    token with the next word in a text) would take the text's first token with it: a warning names it."""
    if sink and prompt_token_count(tokenizer, sink) < 1:
        raise ConfigError(f"{where} {sink!r} tokenizes to no token that pooling would leave out (sentence-transformers "
                          f"does not count a special token at a prompt's end): use a plain text such as {DEFAULT_SINK!r}")
    for name, prompt in (prompts or {}).items() if sink else ():
        n = prompt_token_count(tokenizer, sink + prompt)
        alone = tokenizer([sink + prompt], add_special_tokens=True)["input_ids"][0][:n]
        texts = [sink + prompt + word for word in ("the", "a", "word", "text")]  # common words a space merges with
        if any(ids[:n] != alone for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]):
            log.warning("prompt %r (%r) ends inside the token its text starts with (a trailing space?): with "
                        "export.sink_prompt the prompt is left out of pooling, and that token with it, as "
                        "sentence-transformers counts prompts; end the prompt at a token boundary (%r)",
                        name, prompt, prompt.rstrip())
