"""An exported encoder runs through ``mteb.evaluate`` (offline mock retrieval, classification and STS
tasks) via :class:`adapt.inference.encoder.MTEBAdapter`, with the query prompt applied to retrieval queries, and an encoder
exported with a sink prompt getting it on every text."""
import numpy as np
import pytest

from adapt.model.bidirectional import make_bidirectional
from adapt.inference.encoder import MTEBAdapter, load_encoder
from adapt.export.dense import export_encoder
from tests.tiny import tiny_decoder

mteb = pytest.importorskip("mteb")
from mteb.mocks.mock_tasks import MockClassificationTask, MockRetrievalTask, MockSTSTask  # noqa: E402


def _export(folder, **kwargs):
    from tests.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    out = export_encoder(make_bidirectional(tiny_decoder("llama", vocab_size=len(tok))), tok, folder,
                         prompts={"query": "query: ", "document": ""}, **kwargs)
    return load_encoder(out)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return _export(tmp_path_factory.mktemp("enc") / "enc")


def _evaluate(encoder):
    """mteb's scores on the three mock tasks, and the prompt each encode call resolved to."""
    adapter = MTEBAdapter(encoder)
    prompts = []
    real_encode = encoder.encode

    def spy(texts, **kwargs):
        prompts.append(encoder.resolve_prompt(kwargs.get("prompt_name"), kwargs.get("prompt")))
        return real_encode(texts, **kwargs)

    encoder.encode = spy
    try:
        result = mteb.evaluate(adapter, [MockRetrievalTask(), MockClassificationTask(), MockSTSTask()], cache=None,
                               show_progress_bar=False)
    finally:
        del encoder.encode
    return result, {r.task_name: r.get_score() for r in result.task_results}, prompts


def test_mock_tasks_run(encoder):
    result, scores, prompts = _evaluate(encoder)
    assert set(scores) == {"MockRetrievalTask", "MockClassificationTask", "MockSTSTask"}
    assert all(np.isfinite(s) for s in scores.values()), scores
    assert "query: " in prompts and "" in prompts  # retrieval queries got the query prompt, the rest none
    assert result.model_name == f"adapt/{encoder.name}" and result.model_revision == encoder.fingerprint


def test_a_sink_prompt_reaches_every_text(tmp_path):
    _, scores, prompts = _evaluate(_export(tmp_path / "sunk", sink_prompt="\n"))
    assert all(np.isfinite(s) for s in scores.values()), scores
    assert "\nquery: " in prompts and set(prompts) <= {"\nquery: ", "\n"}  # the sink on every call


def test_similarity_is_cosine(encoder):
    adapter = MTEBAdapter(encoder)
    a = encoder.encode(["one text", "another"])
    sim = np.asarray(adapter.similarity(a, a))
    assert np.allclose(np.diag(sim), 1, atol=1e-5) and sim.shape == (2, 2)
    assert np.allclose(np.asarray(adapter.similarity_pairwise(a, a[::-1])), sim[0, 1], atol=1e-5)
