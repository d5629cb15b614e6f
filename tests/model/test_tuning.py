"""Full, LoRA and QLoRA (bitsandbytes on CPU) steps whose loss falls on a fixed batch; merging."""
import pytest
import torch

from adapt.config.settings import ModelConfig, TuningConfig
from adapt.model.loading import load_decoder, setup_mask_token
from adapt.objectives.masking import LabeledPositionsLM, mask_batch
from adapt.model.tuning import apply_tuning, merged_model, trainable_parameters


def _fixed_batch(tok, mask_id, vocab):
    text = ["the quick brown fox jumps over the lazy dog and reads text", "an encoder reads the whole sentence at once"]
    ids = tok(text, padding="max_length", max_length=16, truncation=True, return_tensors="pt")["input_ids"]
    return mask_batch(ids, "mlm", mask_token_id=mask_id, vocab_size=vocab, special_ids=[0, 1, 2], ratio=0.4,
                      generator=torch.Generator().manual_seed(0))


def _train_steps(model, inputs, labels, steps=12, lr=2e-2):
    wrapper = LabeledPositionsLM(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        loss = wrapper(input_ids=inputs, labels=labels)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("method", ["full", "lora", "qlora4", "qlora8"])
def test_loss_falls_on_a_fixed_batch(tiny_model_dir, method):
    name = "qlora" if method.startswith("qlora") else method
    tuning = TuningConfig(method=name, quant_bits=8 if method == "qlora8" else 4, lora_r=8, lora_alpha=16, lora_dropout=0.0)
    model, tok = load_decoder(ModelConfig(source=str(tiny_model_dir)), tuning)
    mask = setup_mask_token(model, tok, "auto")
    model = apply_tuning(model, tuning, new_token_ids=[mask.id])
    trainable, total = trainable_parameters(model)
    if name == "full":
        assert trainable == total
    else:
        assert 0 < trainable < total / 2
    inputs, labels = _fixed_batch(tok, mask.id, len(tok))
    losses = _train_steps(model, inputs, labels)
    assert losses[-1] < losses[0] - 0.2, losses  # a frozen random LM head limits how far LoRA can go


def test_lora_new_mask_token_row_is_trained_and_merged(tiny_model_dir):
    tuning = TuningConfig(method="lora", lora_r=4, lora_alpha=8, lora_dropout=0.0)
    model, tok = load_decoder(ModelConfig(source=str(tiny_model_dir)), tuning)
    mask = setup_mask_token(model, tok, "auto")
    before = model.get_input_embeddings().weight[mask.id].detach().clone()
    other = model.get_input_embeddings().weight[5].detach().clone()
    model = apply_tuning(model, tuning, new_token_ids=[mask.id])
    inputs, labels = _fixed_batch(tok, mask.id, len(tok))
    _train_steps(model, inputs, labels, steps=3)
    merged = merged_model(model, tuning)
    assert not hasattr(merged, "peft_config")
    emb = merged.get_input_embeddings().weight
    assert not torch.allclose(emb[mask.id], before), "the new mask token's embedding did not train under LoRA"
    assert torch.allclose(emb[5], other), "frozen rows changed"


def test_lora_merge_keeps_outputs(tiny_model_dir):
    tuning = TuningConfig(method="lora", lora_r=4, lora_alpha=8, lora_dropout=0.0)
    model, tok = load_decoder(ModelConfig(source=str(tiny_model_dir)), tuning)
    model = apply_tuning(model, tuning)
    inputs, labels = _fixed_batch(tok, 3, len(tok))
    _train_steps(model, inputs, labels, steps=2)
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=inputs).logits
        merged = merged_model(model, tuning)
        out = merged(input_ids=inputs).logits
    assert torch.allclose(ref, out, atol=1e-4)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lean_qlora_matches_peft_preparation(tiny_model_dir, checkpointing):
    """kbit_fp32=norms/none (embeddings and head stay bf16; none: norms too) train like peft's all-fp32
    preparation, in less memory; auto picks none for a bf16 model."""

    runs = {}
    for mode in ("all", "norms", "none", "auto"):
        tuning = TuningConfig(method="qlora", lora_r=8, lora_alpha=16, lora_dropout=0.0, kbit_fp32=mode,
                              gradient_checkpointing=checkpointing)
        torch.manual_seed(0)
        model, tok = load_decoder(ModelConfig(source=str(tiny_model_dir)), tuning)
        mask = setup_mask_token(model, tok, "auto")
        model = apply_tuning(model, tuning, new_token_ids=[mask.id])
        emb = model.get_input_embeddings()
        emb = getattr(getattr(emb, "token_adapter", emb), "base_layer", emb)
        norm = model.get_base_model().model.norm.weight
        runs[mode] = dict(losses=_train_steps(model, *_fixed_batch(tok, mask.id, len(tok)), steps=6),
                          emb=emb.weight.dtype, norm=norm.dtype,
                          bytes=sum(p.numel() * p.element_size() for p in model.parameters()))
    peft_run = runs["all"]
    assert peft_run["emb"] == torch.float32 and peft_run["norm"] == torch.float32
    assert runs["norms"]["emb"] == torch.bfloat16 and runs["norms"]["norm"] == torch.float32
    assert runs["none"]["emb"] == torch.bfloat16 and runs["none"]["norm"] == torch.bfloat16
    assert runs["auto"]["losses"] == runs["none"]["losses"] and runs["auto"]["norm"] == torch.bfloat16
    assert runs["none"]["bytes"] < runs["norms"]["bytes"] < peft_run["bytes"]
    peft_losses = peft_run["losses"]
    for mode in ("norms", "none"):
        lean_losses = runs[mode]["losses"]
        assert abs(lean_losses[0] - peft_losses[0]) < 0.02 * peft_losses[0], (mode, lean_losses, peft_losses)
        assert lean_losses[-1] < lean_losses[0] - 0.2, (mode, lean_losses)
        assert abs(lean_losses[-1] - peft_losses[-1]) < 0.1 * peft_losses[0], (mode, lean_losses, peft_losses)


def test_kbit_auto_keeps_fp32_norms_for_float16():
    """fp16 has a narrow range: auto casts a float16 model's norms to fp32, as peft would."""
    from tests.tiny import tiny_decoder
    from adapt.model.tuning import prepare_kbit_lean

    for dtype, expect in ((torch.float16, "norms"), (torch.bfloat16, "none")):
        model = tiny_decoder("llama", vocab_size=300).to(dtype)
        assert prepare_kbit_lean(model, "auto") == expect
        assert model.model.norm.weight.dtype == (torch.float32 if expect == "norms" else dtype)
        assert model.get_input_embeddings().weight.dtype == dtype and not any(p.requires_grad for p in model.parameters())


def test_quantized_load_owns_its_unquantized_weights_and_keeps_ties(tmp_path, tokenizer):
    """release_load_memory copies the weights bitsandbytes left unquantized: values, ties and training unchanged."""
    from tests.tiny import tiny_decoder

    src = tmp_path / "tied"
    model = tiny_decoder("llama", vocab_size=len(tokenizer), tie_word_embeddings=True)
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)
    tuning = TuningConfig(method="qlora", lora_r=4, lora_alpha=8, lora_dropout=0.0)
    q, _ = load_decoder(ModelConfig(source=str(src)), tuning)
    assert q.get_output_embeddings().weight is q.get_input_embeddings().weight
    saved = model.get_input_embeddings().weight.to(q.get_input_embeddings().weight.dtype)
    assert torch.equal(q.get_input_embeddings().weight, saved)
