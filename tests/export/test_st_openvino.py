"""``SentenceTransformer(DIR, backend="openvino")`` runs the graph ``adapt export --backend openvino`` wrote,
with no custom code: loaded from ``openvino/openvino_model.xml`` (not re-exported), bidirectional, and
giving the torch encoder's vectors.

Runs only where optimum-intel imports. optimum-intel 2.2.0 needs transformers < 5.6, so `make test`
(newest transformers) skips it; verified with transformers 5.5.4, optimum-intel 2.2.0, OpenVINO 2026.4.1
and sentence-transformers 6.3.0 (DEVELOPERS.md, "sentence-transformers backends"). The ONNX twin,
``backend="onnx"``, needs optimum-onnx, which does not install with transformers 5 yet.
"""
import json
import warnings

import numpy as np
import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("optimum.intel.openvino", reason="optimum-intel is not installed (2.2.0 needs transformers < 5.6)")

from sentence_transformers import SentenceTransformer  # noqa: E402

from adapt.model.families import facts_for  # noqa: E402
from adapt.model.bidirectional import make_bidirectional  # noqa: E402
from adapt.cli import main  # noqa: E402
from adapt.inference.encoder import load_encoder  # noqa: E402
from adapt.export.dense import export_encoder  # noqa: E402
from tests.tiny import CORPUS, tiny_decoder, tiny_tokenizer  # noqa: E402

F32 = {"ov_config": {"INFERENCE_PRECISION_HINT": "f32"}}  # OpenVINO runs bf16 on CPUs with bf16 units otherwise
TEXTS = [CORPUS[i:i + 5 + (11 * i) % 150] for i in range(0, 900, 41)] + ["é, ü, 東京 and emoji 🙂 are text too."]


def cosines(a, b):
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def first_token_moves(st) -> list[float]:
    """How far the first token's state moves when the last real token changes, in the graph
    sentence-transformers runs (unpadded, right padding): 0 for a causal graph."""
    model, vocab, pad_id = st[0].auto_model, len(st.tokenizer), st.tokenizer.pad_token_id
    n = 16  # past the tiny sliding windows (4), as adapt.model.bidirectional.probe does
    ids = torch.randint(16, vocab, (2, n), generator=torch.Generator().manual_seed(0))
    moved = []
    for pad in (0, 4):
        a = torch.cat([ids, torch.full((2, pad), pad_id)], 1)
        mask = (torch.arange(n + pad) < n).long().expand(2, -1).contiguous()
        b = a.clone()
        b[:, n - 1] = 16 + (a[:, n - 1] - 15) % (vocab - 16)
        first_a, first_b = (model(input_ids=x, attention_mask=mask).last_hidden_state[:, 0] for x in (a, b))
        moved.append(float((first_a - first_b).abs().max() / first_a.abs().mean()))
    return moved


@pytest.mark.parametrize("family,quantize", [
    ("llama", None),  # RoPE, SDPA
    pytest.param("gpt2", None, marks=pytest.mark.slow),  # absolute positions, computed inside the graph
    pytest.param("gemma2", None, marks=pytest.mark.slow),  # eager attention pinned, sliding window
    pytest.param("llama", "int8", marks=pytest.mark.slow),  # NNCF int8 weights
])
def test_sentence_transformers_loads_the_openvino_export(family, quantize, tmp_path):
    tok = tiny_tokenizer()
    model = make_bidirectional(tiny_decoder(family, vocab_size=len(tok),
                                            attn_implementation=facts_for(family).attn_implementations[0]))
    source = export_encoder(model, tok, tmp_path / "enc", max_seq_length=48, prompts={"query": "query: "})
    out = tmp_path / "ov"
    args = ["export", str(source), "-o", str(out), "--backend", "openvino"]
    args += ["--quantize", quantize] if quantize else []
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = SentenceTransformer(str(out), device="cpu")  # the torch weights of the same folder
        graph = SentenceTransformer(str(out), backend="openvino", device="cpu", model_kwargs=F32)
        plain = SentenceTransformer(str(out), backend="openvino", device="cpu")  # default precision
        assert type(graph[0].auto_model).__name__ == "OVModelForFeatureExtraction"
        assert graph[0].auto_model.model_save_dir.resolve() == (out / "openvino").resolve()  # loaded, not re-exported
        assert min(first_token_moves(graph)) > 1e-3

        expected = reference.encode(TEXTS, batch_size=5)
        got = graph.encode(TEXTS, batch_size=5)
        queries = cosines(graph.encode(TEXTS[:4], prompt_name="query"),
                          reference.encode(TEXTS[:4], prompt_name="query"))
        default = cosines(plain.encode(TEXTS, batch_size=5), expected)
        adapt_encoder = load_encoder(out)  # what adapt embed runs: the same graph
        assert type(adapt_encoder.model).__name__ == "BackendModel"
        adapt_vectors = adapt_encoder.encode(TEXTS, batch_size=7)
    if quantize is None:
        assert cosines(got, expected).min() >= 0.9999 and queries.min() >= 0.9999
        assert default.min() >= 0.999, default  # bf16 on CPUs with bf16 units
    else:
        assert cosines(got, expected).min() > 0.99 and default.min() > 0.98
    assert cosines(adapt_vectors, got).min() >= 0.9999
    card = (out / "README.md").read_text(encoding="utf-8")
    assert f'SentenceTransformer("{out.name}", backend="openvino", model_kwargs={json.dumps(F32)})' in card
    assert f"openvino/openvino_model.xml`, {quantize or 'float32'}" in card
