"""Sparse encoders need sentence-transformers >= 6.2: with an older one, the export, the `splade` stage and loading
refuse with the fix before any work, in every venv (the version check is replaced, not the package)."""
import pytest

import adapt.export.sparse as sparse_export
from adapt.model.bidirectional import make_bidirectional
from adapt.errors import ConfigError
from adapt.inference.sparse import load_sparse
from adapt.pipeline.chain import plan_stages
from tests.tiny import tiny_decoder, tiny_tokenizer

FIX = r"need sentence-transformers >= 6\.2\.0 \(installed: .*pip install -U 'sentence-transformers>=6\.2\.0'"


@pytest.fixture
def old_st(monkeypatch):
    monkeypatch.setattr(sparse_export, "sparse_supported", lambda: False)


def test_the_version_check_reads_the_installed_package():
    from importlib.metadata import version

    from packaging.version import Version

    assert sparse_export.sparse_supported() == (Version(version("sentence-transformers")) >= Version("6.2.0"))


def test_an_old_sentence_transformers_is_refused_with_the_fix(old_st, tmp_path):
    tok = tiny_tokenizer()
    model = make_bidirectional(tiny_decoder("llama", vocab_size=len(tok)))
    with pytest.raises(ConfigError, match="sparse exports " + FIX):
        sparse_export.export_sparse(model, tok, tmp_path / "sparse")
    assert not (tmp_path / "sparse").exists()
    with pytest.raises(ConfigError, match="a `splade` stage's sparse encoders " + FIX):
        plan_stages("m", tmp_path / "o", stages="mlm,splade", data=["c.txt"])
    plan_stages("m", tmp_path / "o", stages="mlm,simcse", data=["c.txt"])  # dense chains are not affected
    with pytest.raises(ConfigError, match=FIX):
        load_sparse(tmp_path)
