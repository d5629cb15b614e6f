"""adapt.objectives: label placement and masking statistics, the labelled-positions loss, schedules."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adapt.errors import ConfigError
from adapt.objectives.masking import IGNORE_INDEX, LabeledPositionsLM, mask_batch
from adapt.config.schedule import OBJECTIVES, ObjectiveSchedule
from tests.tiny import TINY_CONFIGS, tiny_decoder

V, MASK, SPECIALS = 320, 3, (0, 1, 2)  # tiny_tokenizer: <pad>=0 <s>=1 </s>=2; <unk>=3 stands in for a mask token


def random_ids(b=4, t=16, seed=0, low=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, V, (b, t), generator=g)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def masked(objective, ids, **kw):
    kw = dict(mask_token_id=MASK, vocab_size=V, special_ids=SPECIALS, generator=gen(), **kw)
    return mask_batch(ids, objective, **kw)


# ------------------------------------------------------------------------------------------ labels

def test_clm_labels_are_the_next_token_and_inputs_are_unchanged():
    ids = random_ids()
    inputs, labels = masked("clm", ids)
    assert torch.equal(inputs, ids)
    assert torch.equal(labels[:, :-1], ids[:, 1:]) and (labels[:, -1] == IGNORE_INDEX).all()


def test_clm_ignores_padding_on_either_side():
    ids = random_ids(2, 8)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1]])
    _, labels = masked("clm", ids, attention_mask=mask)
    assert labels[0].tolist() == ids[0, 1:5].tolist() + [IGNORE_INDEX] * 4
    assert labels[1].tolist() == [IGNORE_INDEX] * 2 + ids[1, 3:].tolist() + [IGNORE_INDEX]


@pytest.mark.parametrize("replacement", ["80-10-10", "mask"])
def test_mlm_labels_sit_on_the_masked_positions(replacement):
    ids = random_ids(8, 32)
    inputs, labels = masked("mlm", ids, replacement=replacement)
    sel = labels != IGNORE_INDEX
    assert torch.equal(labels[sel], ids[sel])
    assert torch.equal(inputs[~sel], ids[~sel])  # nothing outside the labelled positions changes
    if replacement == "mask":
        assert (inputs[sel] == MASK).all()
    else:
        assert (inputs[sel] == MASK).float().mean() > 0.6


@pytest.mark.parametrize("replacement", ["80-10-10", "mask"])
def test_mntp_label_of_masked_token_i_sits_at_i_minus_1(replacement):
    ids = random_ids(8, 32)
    inputs, labels = masked("mntp", ids, replacement=replacement)
    sel = labels != IGNORE_INDEX  # (B, T): position i-1 predicts masked token i
    assert not sel[:, -1].any()  # nothing to the right of the last token
    assert torch.equal(labels[:, :-1][sel[:, :-1]], ids[:, 1:][sel[:, :-1]])
    changed_allowed = torch.zeros_like(sel)
    changed_allowed[:, 1:] = sel[:, :-1]  # the masked tokens themselves
    assert torch.equal(inputs[~changed_allowed], ids[~changed_allowed])
    assert torch.equal(inputs[:, 0], ids[:, 0])  # position 0 has no i-1 to carry its label
    if replacement == "mask":
        assert (inputs[changed_allowed] == MASK).all()


@pytest.mark.parametrize("objective", ["mlm", "mntp"])
def test_special_tokens_and_padding_are_never_masked(objective):
    ids = random_ids(16, 64)
    ids[:, ::3] = torch.tensor(SPECIALS).repeat(16, 22)[:, : ids[:, ::3].shape[1]]  # a third are specials
    pad = torch.ones_like(ids)
    pad[:4, -10:] = 0  # right padding
    pad[4:8, :10] = 0  # left padding
    ids[pad == 0] = 0
    inputs, labels = masked(objective, ids, attention_mask=pad, ratio=0.5)
    target = labels != IGNORE_INDEX
    hit = target if objective == "mlm" else F.pad(target[:, :-1], (1, 0))  # the masked tokens
    assert hit.sum() > 0
    is_special = torch.isin(ids, torch.tensor(SPECIALS))
    assert not (hit & is_special).any() and not (hit & (pad == 0)).any()
    assert torch.equal(inputs[~hit], ids[~hit])
    assert not torch.isin(inputs[hit & (inputs != ids)], torch.tensor(SPECIALS)).any()  # random draws too
    if objective == "mntp":
        assert not (target & (pad == 0)).any()  # labels only at real positions


@pytest.mark.parametrize("objective", ["mlm", "mntp"])
@pytest.mark.parametrize("ratio", [0.15, 0.3, 0.5])
def test_mask_ratio_is_exact_per_row(objective, ratio):
    ids = random_ids(32, 64)
    ids[:, 5] = 2  # one special per row
    _, labels = masked(objective, ids, ratio=ratio)
    maskable = 63 if objective == "mlm" else 62  # minus the special (and position 0 for mntp)
    counts = (labels != IGNORE_INDEX).sum(dim=1)
    assert (counts == round(ratio * maskable)).all()


def test_80_10_10_split_statistics():
    ids = random_ids(128, 128, seed=1)
    inputs, labels = masked("mlm", ids, ratio=0.3)
    sel = labels != IGNORE_INDEX
    n = sel.sum().item()
    to_mask = (inputs[sel] == MASK).float().mean().item()
    kept = (inputs[sel] == ids[sel]).float().mean().item()
    randomised = 1 - to_mask - kept
    assert n == 128 * round(0.3 * 128)
    assert abs(to_mask - 0.8) < 0.02 and abs(kept - 0.1) < 0.015 and abs(randomised - 0.1) < 0.015
    drawn = inputs[sel & (inputs != ids) & (inputs != MASK)]
    assert drawn.min() >= 4 and drawn.max() < V and drawn.unique().numel() > 100  # spread over the vocabulary


def test_masking_positions_are_spread_uniformly():
    ids = random_ids(512, 16, seed=2)
    _, labels = masked("mlm", ids, ratio=0.25)
    per_position = (labels != IGNORE_INDEX).float().mean(dim=0)  # (T,)
    assert (per_position - 0.25).abs().max() < 0.07


def test_masking_is_deterministic_given_a_generator():
    ids = random_ids()
    a = mask_batch(ids, "mlm", mask_token_id=MASK, vocab_size=V, generator=gen(5))
    b = mask_batch(ids, "mlm", mask_token_id=MASK, vocab_size=V, generator=gen(5))
    c = mask_batch(ids, "mlm", mask_token_id=MASK, vocab_size=V, generator=gen(6))
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and not torch.equal(a[1], c[1])


@pytest.mark.parametrize("kwargs, message", [
    (dict(ratio=0.0), "ratio must be in"), (dict(ratio=1.0), "ratio must be in"), (dict(ratio=-1), "ratio"),
    (dict(replacement="random"), "unknown mask replacement 'random'"),
    (dict(objective="mlmx"), "unknown objective 'mlmx'"),
    (dict(mask_token_id=None), "needs a mask token"),
])
def test_mask_batch_validation(kwargs, message):
    args = dict(objective="mlm", mask_token_id=MASK, vocab_size=V)
    args.update(kwargs)
    with pytest.raises(ConfigError, match=message):
        mask_batch(random_ids(), args.pop("objective"), **args)


def test_clm_needs_no_mask_token():
    _, labels = mask_batch(random_ids(), "clm", mask_token_id=None, vocab_size=V)
    assert (labels[:, :-1] != IGNORE_INDEX).all()


# -------------------------------------------------------------------------------------------- loss

# Post-processing made strong enough that skipping it would change the loss.
POSTPROCESSING = {"gemma2": dict(final_logit_softcapping=0.1), "gemma3_text": dict(final_logit_softcapping=0.1),
                  "granite": dict(logits_scaling=4.0)}


def reference_loss(logits, labels):
    sel = labels != IGNORE_INDEX
    return F.cross_entropy(logits[sel].float(), labels[sel])


@pytest.mark.parametrize("family", list(TINY_CONFIGS))
@pytest.mark.parametrize("objective", ["mlm", "mntp"])
def test_loss_equals_the_models_own_logits_at_labelled_positions(family, objective):
    model = tiny_decoder(family, **POSTPROCESSING.get(family, {}))  # eval mode: no dropout, grads still flow
    inputs, labels = masked(objective, random_ids(2, 12))
    head_rows = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, a, out: head_rows.append(out.shape))
    out = LabeledPositionsLM(model)(inputs, labels)
    hook.remove()
    n = int((labels != IGNORE_INDEX).sum())
    assert int(out["n_labels"]) == n and head_rows[0][:-1] == (1, n)  # the head ran on labelled rows only
    out["loss"].backward()
    ours = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    full = model(inputs).logits  # (B, T, V)
    ref = reference_loss(full, labels)
    ref.backward()
    torch.testing.assert_close(out["loss"], ref, rtol=1e-5, atol=1e-6)
    assert int(out["n_correct"]) == int((full[labels != IGNORE_INDEX].argmax(-1) == labels[labels != IGNORE_INDEX]).sum())
    refs = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert ours.keys() == refs.keys() and len(ours) > 0
    for k in ours:
        torch.testing.assert_close(ours[k], refs[k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", list(POSTPROCESSING))
def test_family_postprocessing_matters_in_those_tests(family):
    """Guards the test above: the plain LM head alone would give a different loss for these configs."""
    model = tiny_decoder(family, **POSTPROCESSING[family])
    inputs, labels = masked("mlm", random_ids(2, 12))
    with torch.no_grad():
        out = model(inputs, output_hidden_states=True)
        naive = reference_loss(model.get_output_embeddings()(out.hidden_states[-1]), labels)
        ours = LabeledPositionsLM(model)(inputs, labels)["loss"]
    torch.testing.assert_close(ours, reference_loss(out.logits, labels))
    assert abs(float(naive) - float(ours)) > 1e-3  # far beyond the 1e-5 relative tolerance above


def test_loss_with_padding_matches_the_model():
    model = tiny_decoder("llama")
    inputs, labels = masked("mlm", random_ids(2, 12))
    attn = torch.ones_like(inputs)
    attn[0, -4:] = 0
    labels[attn == 0] = IGNORE_INDEX
    with torch.no_grad():
        out = LabeledPositionsLM(model)(inputs, labels, attention_mask=attn)
        ref = reference_loss(model(inputs, attention_mask=attn).logits, labels)
    torch.testing.assert_close(out["loss"], ref)


def test_falls_back_to_full_logits_when_the_head_module_is_not_called(monkeypatch):
    model = tiny_decoder("llama")
    inputs, labels = masked("mlm", random_ids(2, 12))
    monkeypatch.setattr(model, "get_output_embeddings", lambda: torch.nn.Identity())  # never called by forward
    with torch.no_grad():
        out = LabeledPositionsLM(model)(inputs, labels)
        ref = reference_loss(model(inputs).logits, labels)
    torch.testing.assert_close(out["loss"], ref)


def test_lora_wrapped_model_trains_only_the_adapters():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_decoder("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                             init_lora_weights=False))
    inputs, labels = masked("mlm", random_ids(2, 12))
    wrapper = LabeledPositionsLM(model)
    out = wrapper(inputs, labels)
    ref = reference_loss(model(input_ids=inputs).logits, labels)
    torch.testing.assert_close(out["loss"], ref)
    base = model.get_base_model()
    with model.disable_adapter(), torch.no_grad():
        assert abs(float(reference_loss(base(inputs).logits, labels)) - float(ref)) > 1e-4  # adapters are in the path
    out["loss"].backward()
    grads = {k: p.grad for k, p in wrapper.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in k for k in grads) and all(g.abs().sum() > 0 for g in grads.values())
    assert {k for k, p in wrapper.named_parameters() if p.requires_grad} == set(grads)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_clm_with_causal_true_is_the_standard_causal_loss_on_a_bidirectional_model(family):
    model = tiny_decoder(family)
    ids = random_ids(2, 12)
    with torch.no_grad():
        standard = model(ids, labels=ids).loss  # HF's shifted causal loss
        model.config.is_causal = False  # as after make_bidirectional
        inputs, labels = masked("clm", ids)
        wrapper = LabeledPositionsLM(model)
        causal = wrapper(inputs, labels, causal=True)["loss"]
        bidirectional = wrapper(inputs, labels)["loss"]
    torch.testing.assert_close(causal, standard)
    assert abs(float(bidirectional) - float(standard)) > 1e-4  # the attention really switched
    assert model.config.is_causal is False  # and switched back


def test_no_labels_gives_zero_loss_with_a_graph():
    model = tiny_decoder("llama")
    ids = random_ids(2, 8)
    out = LabeledPositionsLM(model)(ids, torch.full_like(ids, IGNORE_INDEX))
    assert out["loss"].item() == 0.0 and int(out["n_labels"]) == 0 and int(out["n_correct"]) == 0
    assert out["loss"].requires_grad
    out["loss"].backward()
    assert all(p.grad is None or (p.grad == 0).all() for p in model.parameters())


# ---------------------------------------------------------------------------------------- schedule

def draws(schedule, total, steps=None):
    return [schedule.objective_at(s, total) for s in (steps if steps is not None else range(total))]


def test_single_objective():
    s = ObjectiveSchedule("mntp")
    assert set(draws(s, 50)) == {"mntp"} and s.objectives == {"mntp"} and s.to_spec() == "mntp"


def test_mixture_frequencies_and_determinism():
    s = ObjectiveSchedule({"mlm": 0.75, "clm": 0.25}, seed=3)
    d = draws(s, 4000)
    assert abs(d.count("clm") / 4000 - 0.25) < 0.03 and set(d) == {"mlm", "clm"}
    assert d == draws(ObjectiveSchedule({"mlm": 0.75, "clm": 0.25}, seed=3), 4000)
    assert d != draws(ObjectiveSchedule({"mlm": 0.75, "clm": 0.25}, seed=4), 4000)
    assert draws(s, 4000, range(3999, -1, -1))[::-1] == d  # a pure function of the step: order-free, resumable
    assert s.objectives == {"mlm", "clm"}
    weights = ObjectiveSchedule({"mlm": 3, "mntp": 1, "clm": 0.5})
    d = draws(weights, 4500)
    assert abs(d.count("mlm") / 4500 - 3 / 4.5) < 0.03 and abs(d.count("clm") / 4500 - 0.5 / 4.5) < 0.02


def test_phases_by_fraction():
    s = ObjectiveSchedule([{"objective": "clm", "until": 0.5}, {"objective": "mlm"}])
    assert draws(s, 100) == ["clm"] * 50 + ["mlm"] * 50
    assert draws(s, 10) == ["clm"] * 5 + ["mlm"] * 5
    assert s.objective_at(500, 100) == "mlm"  # past the end: the last phase


def test_phases_by_step_with_a_mixture_phase():
    s = ObjectiveSchedule([{"objective": "clm", "until": 10}, {"objective": "mntp", "until": 0.5},
                           {"objective": {"mlm": 1, "mntp": 1}, "until": 1.0}], seed=1)
    d = draws(s, 100)
    assert d[:10] == ["clm"] * 10 and d[10:50] == ["mntp"] * 40 and set(d[50:]) == {"mlm", "mntp"}
    assert s.objectives == {"clm", "mlm", "mntp"}
    with pytest.raises(ConfigError, match="not in increasing order"):
        s.objective_at(0, 16)  # step 10 comes after half of 16 steps


@pytest.mark.parametrize("spec", [
    "mlm", {"mlm": 0.75, "clm": 0.25},
    [{"objective": "clm", "until": 0.5}, {"objective": "mlm"}],
    [{"objective": {"clm": 1, "mlm": 2}, "until": 100}, {"objective": "mntp", "until": 1.0}],
])
def test_spec_round_trip(spec):
    yaml = pytest.importorskip("yaml")
    s = ObjectiveSchedule(spec, seed=2)
    assert s.to_spec() == spec
    assert ObjectiveSchedule(yaml.safe_load(yaml.safe_dump(s.to_spec())), seed=2) == s
    assert draws(ObjectiveSchedule(s.to_spec(), seed=2), 300) == draws(s, 300)


@pytest.mark.parametrize("spec, message", [
    ("bert", "unknown objective 'bert'"),
    ({"mlm": 1, "xlm": 1}, "unknown objective 'xlm'"),
    ({"mlm": 0, "clm": 1}, "weight of 'mlm' must be a positive number"),
    ({"mlm": -1}, "positive"), ({"mlm": "a lot"}, "positive"), ({"mlm": True}, "positive"),
    ({}, "expected an objective name or a mixture"), (3, "expected an objective name"),
    ([], "the list is empty"),
    ([{"objective": "clm", "until": 0.5}], "last phase runs to the end"),
    ([{"objective": "clm", "until": 0.5}, {"objective": "mlm", "until": 100}], "last phase runs to the end"),
    ([{"objective": "clm"}, {"objective": "mlm"}], r"phase 1: `until` must be"),
    ([{"objective": "clm", "until": 1.5}, {"objective": "mlm"}], "phase 1: `until` must be"),
    ([{"objective": "clm", "until": 0}, {"objective": "mlm"}], "phase 1: `until` must be"),
    ([{"objective": "clm", "until": 0.6}, {"objective": "mntp", "until": 0.4}, {"objective": "mlm"}],
     "increasing order"),
    ([{"objective": "clm", "until": 50}, {"objective": "mntp", "until": 50}, {"objective": "mlm"}],
     "increasing order"),
    ([{"objective": "clm", "until": 0.5, "weight": 1}, {"objective": "mlm"}], "expected"),
    (["clm", "mlm"], "expected"),
    ([{"objective": "clm", "until": 0.5}, {"objective": "xlm"}], "unknown objective 'xlm'"),
])
def test_schedule_validation(spec, message):
    with pytest.raises(ConfigError, match=message):
        ObjectiveSchedule(spec)


def test_objectives_constant():
    assert OBJECTIVES == ("mlm", "mntp", "clm")


# ---- evaluation sharded over processes ---------------------------------------------------------

class _FakeProcess:
    """What an objective's evaluate uses of an Accelerator, for process ``rank`` of ``world``; the
    gather returns this process's rows only, and the test adds the processes up."""

    def __init__(self, rank, world):
        self.process_index, self.num_processes, self.device = rank, world, torch.device("cpu")
        self.gathered = []

    def gather_for_metrics(self, tensor):
        self.gathered.append(tensor.clone())
        return tensor

    def unwrap_model(self, module):
        return module

    def autocast(self):
        import contextlib

        return contextlib.nullcontext()


def test_masked_eval_shards_rows_over_processes_and_sums_to_the_single_process_figures(tmp_path, tokenizer):
    from adapt.config.settings import RunConfig
    from adapt.data.token_store import build_token_store
    from adapt.objectives.masked import MaskedLM
    from tests.tiny import CORPUS, tiny_decoder

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join([CORPUS] * 6))
    cfg = RunConfig.from_dict({"objective": {"schedule": {"mlm": 1, "clm": 1}},
                               "train": {"batch_size": 3, "eval_batches": 2}})
    model = tiny_decoder("llama", vocab_size=len(tokenizer))
    objective = MaskedLM(cfg)
    objective.configure_model(model, tokenizer)
    objective.store = build_token_store([corpus], tokenizer, tmp_path / "store", seq_len=16, eval_fraction=0.3,
                                        show_progress=False)
    assert len(objective.store.eval) >= 5  # two batches of 3, the second one short or full
    module = objective.module(model)
    alone = _FakeProcess(0, 1)
    single = objective.evaluate(module, alone)
    ranks = [_FakeProcess(r, 2) for r in range(2)]
    for process in ranks:
        objective.evaluate(module, process)
    for i, name in enumerate(sorted(["mlm", "clm"])):
        total = ranks[0].gathered[i] + ranks[1].gathered[i]  # (1, 3): loss x labels, labels, correct
        assert float(ranks[0].gathered[i][0, 1]) > 0 and float(ranks[1].gathered[i][0, 1]) > 0  # both did work
        assert float(total[0, 1]) == float(alone.gathered[i][0, 1])  # ... each on its share of the labels
        assert float(total[0, 0] / total[0, 1]) == pytest.approx(single[f"eval/{name}_loss"], rel=1e-5)
        assert float(total[0, 2] / total[0, 1]) == pytest.approx(single[f"eval/{name}_acc"], rel=1e-6)


@pytest.mark.parametrize("kind, name", [("cosine", "cosine"), ("linear", "linear"),
                                        ("constant", "constant_with_warmup")])
def test_lr_schedules_equal_transformers_schedules(kind, name):
    from transformers import get_scheduler

    from adapt.config.settings import TrainConfig
    from adapt.training.loop import build_scheduler

    def lrs(make):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        sched = make(opt)
        out = []
        for _ in range(20):
            out.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        return out

    train = TrainConfig(max_steps=20, warmup_ratio=0.2, scheduler=kind)
    ours = lrs(lambda opt: build_scheduler(opt, train))
    theirs = lrs(lambda opt: get_scheduler(name, opt, num_warmup_steps=4, num_training_steps=20))
    assert ours == pytest.approx(theirs, abs=1e-12)
