"""``remat.integrations.transformers.RematTrainer`` against the plain ``transformers.Trainer``:
same seed, schedule (warmup + cosine), clipping and gradient accumulation give the same logged
losses and parameters; LoRA (peft) leaves frozen parameters without gradients; a resumed run ends
where an uninterrupted one does; bf16 trains as the plain Trainer's bf16; fp16 is refused by name."""
import pytest
import torch

pytest.importorskip("transformers")
import transformers  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from remat.integrations.transformers import RematTrainer  # noqa: E402

transformers.logging.set_verbosity_error()

VOCAB = 256


class TokenData(torch.utils.data.Dataset):
    """``n`` random token sequences (causal LM: the labels are the inputs); ``lengths`` cycles
    through sequence lengths (padded by the collator), else all are ``length`` long."""

    def __init__(self, n: int, length: int = 32, classes: int | None = None, lengths=None):
        g = torch.Generator().manual_seed(1)
        self.rows = [torch.randint(1, VOCAB, (lengths[i % len(lengths)] if lengths else length,), generator=g)
                     for i in range(n)]
        self.classes = None if classes is None else torch.randint(0, classes, (n,), generator=g)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        if self.classes is None:
            return dict(input_ids=self.rows[i], labels=self.rows[i])
        return dict(input_ids=self.rows[i], labels=self.classes[i])


def _args(tmp_path, name, **kw):
    base = dict(output_dir=str(tmp_path / name), report_to=[], use_cpu=True, logging_steps=1, save_strategy="no",
                max_steps=4, per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=2e-3,
                lr_scheduler_type="cosine", warmup_steps=2, max_grad_norm=1.0, seed=0, disable_tqdm=True,
                dataloader_num_workers=0)
    return TrainingArguments(**{**base, **kw})


def _train(cls, make_model, data, tmp_path, name, collator=None, resume=None, eval_data=None, **kw):
    """A fresh seeded model trained by ``cls``; (trainer, logged losses, final parameters)."""
    remat_kw = {k: kw.pop(k) for k in ("budget", "remat_options") if k in kw}
    torch.manual_seed(0)
    model = make_model()
    trainer = cls(model=model, args=_args(tmp_path, name, **kw), train_dataset=data, data_collator=collator,
                  eval_dataset=eval_data, **remat_kw)
    trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses, {k: p.detach().clone() for k, p in model.named_parameters()}


def _close(plain, remat, rel=1e-3):
    (_, la, pa), (_, lb, pb) = plain, remat
    assert len(la) == len(lb) >= 4
    for a, b in zip(la, lb):
        assert abs(a - b) <= rel * abs(a), (la, lb)
    for k in pa:
        assert torch.allclose(pa[k], pb[k], rtol=1e-3, atol=1e-5), k


def _within_budget(trainer):
    r = trainer.remat_report()
    assert r.budget is not None and r.measured_peak is not None
    assert r.measured_peak == r.predicted_peak <= r.budget
    assert r.measured_allocator_peak is None or r.measured_allocator_peak <= r.budget
    return r


def _qwen2():
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB)
    return transformers.Qwen2ForCausalLM(cfg)


def _bert():
    cfg = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  vocab_size=VOCAB, num_labels=3, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, max_position_embeddings=64)
    return transformers.BertForSequenceClassification(cfg)


def _llama():
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB)
    return transformers.LlamaForCausalLM(cfg)


def test_causal_lm_matches_plain_trainer(tmp_path):
    """Qwen2 (the model normalises its loss by the accumulated batch's tokens, num_items_in_batch),
    with the Trainer's evaluation every 2 steps."""
    data, held_out = TokenData(32), TokenData(8)
    evaluate = dict(eval_data=held_out, eval_strategy="steps", eval_steps=2)
    plain = _train(Trainer, _qwen2, data, tmp_path, "plain", **evaluate)
    ours = _train(RematTrainer, _qwen2, data, tmp_path, "remat", budget="92%", **evaluate)
    _close(plain, ours)
    eval_losses = [[h["eval_loss"] for h in t.state.log_history if "eval_loss" in h] for t in (plain[0], ours[0])]
    assert len(eval_losses[0]) == 2 and eval_losses[0] == pytest.approx(eval_losses[1], rel=1e-5)
    r = _within_budget(ours[0])
    assert r.recomputed_instructions > 0  # the budget made it recompute
    grad_norms = [[h["grad_norm"] for h in t.state.log_history if "grad_norm" in h] for t in (plain[0], ours[0])]
    assert grad_norms[0] == pytest.approx(grad_norms[1], rel=1e-4)


def test_classifier_with_padding_matches_plain_trainer(tmp_path):
    """BERT sequence classification on sequences of several lengths, padded to multiples of 8:
    one compiled step per padded length (a budget in bytes: a relative one is resolved against the
    first batch's peak and would not fit a longer batch), the same losses as the plain Trainer."""
    data = TokenData(16, classes=3, lengths=[20, 13, 9, 24, 7, 16, 11, 22])
    collator = transformers.DataCollatorWithPadding(_PadOnly(), pad_to_multiple_of=8)
    plain = _train(Trainer, _bert, data, tmp_path, "plain", collator=collator)
    ours = _train(RematTrainer, _bert, data, tmp_path, "remat", collator=collator, budget=900_000)
    _close(plain, ours)
    _within_budget(ours[0])
    assert ours[0].remat_step.shapes_cached() > 1


class _PadOnly:
    """The part of a tokenizer ``DataCollatorWithPadding`` uses: ``pad`` (pad id 0, right side)."""

    padding_side = "right"

    def pad(self, features, padding=True, max_length=None, pad_to_multiple_of=None, return_tensors="pt"):
        n = max(len(f["input_ids"]) for f in features)
        n = -(-n // pad_to_multiple_of) * pad_to_multiple_of if pad_to_multiple_of else n
        ids = torch.zeros(len(features), n, dtype=torch.long)
        mask = torch.zeros(len(features), n, dtype=torch.long)
        for i, f in enumerate(features):
            ids[i, :len(f["input_ids"])] = torch.as_tensor(f["input_ids"])
            mask[i, :len(f["input_ids"])] = 1
        out = dict(input_ids=ids, attention_mask=mask)
        if "labels" in features[0]:
            out["labels"] = torch.stack([torch.as_tensor(f["labels"]) for f in features])
        return out


def test_lora_matches_plain_trainer(tmp_path):
    """LoRA through peft on a tiny Llama: frozen base weights get no gradient, the losses match."""
    peft = pytest.importorskip("peft")

    def lora():
        return peft.get_peft_model(_llama(), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                             target_modules=["q_proj", "v_proj"]))

    data = TokenData(32)
    plain = _train(Trainer, lora, data, tmp_path, "plain")
    ours = _train(RematTrainer, lora, data, tmp_path, "remat", budget="95%")
    _close(plain, ours)
    _within_budget(ours[0])
    trainer = ours[0]
    model = trainer.model
    model.zero_grad()
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.training_step(model, batch, trainer._get_num_items_in_batch([batch], trainer.args.device))
    named = dict(model.named_parameters())
    frozen = [k for k, p in named.items() if not p.requires_grad]
    assert frozen and all(named[k].grad is None for k in frozen)
    assert all(p.grad is not None for p in named.values() if p.requires_grad)


def test_resume_from_checkpoint_matches_uninterrupted_run(tmp_path):
    data = TokenData(32)
    whole = _train(RematTrainer, _llama, data, tmp_path, "whole", budget="92%", save_strategy="steps", save_steps=2)
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    assert checkpoint.is_dir()
    resumed = _train(RematTrainer, _llama, data, tmp_path, "resumed", budget="92%", resume=str(checkpoint))
    assert resumed[0].state.global_step == 4
    assert resumed[1] == pytest.approx(whole[1], rel=1e-6)  # the checkpoint's log history, then the steps after it
    for k, p in whole[2].items():
        assert torch.equal(p, resumed[2][k]), k


def test_fp16_is_refused(tmp_path):
    with pytest.raises(NotImplementedError, match="fp16=True.*not available yet"):
        RematTrainer(model=_llama(), args=_args(tmp_path, "mp", fp16=True), train_dataset=TokenData(4))


@pytest.mark.parametrize("name", ["activation_checkpointing", "gradient_checkpointing"])
def test_activation_checkpointing_is_refused_by_the_name_given(tmp_path, name):
    with pytest.raises(NotImplementedError, match="activation checkpointing.*set activation_checkpointing=False "
                                                  "and gradient_checkpointing=False"):
        RematTrainer(model=_llama(), args=_args(tmp_path, "ac", **{name: True}), train_dataset=TokenData(4))


def test_torch_compile_is_said_to_compile_evaluation_only(tmp_path):
    with pytest.warns(UserWarning, match="torch_compile=True compiles evaluation and prediction only") as seen:
        RematTrainer(model=_llama(), args=_args(tmp_path, "tc", torch_compile=True), train_dataset=TokenData(4))
    assert sum("torch_compile=True" in str(w.message) for w in seen) == 1


def test_bf16_trains_like_the_plain_trainer_under_bf16(tmp_path):
    """bf16=True: the Trainer's bf16 autocast and remat's precision="bf16" compute alike (bf16
    rounding apart: the kernels are not the same), the master weights stay fp32."""
    data = TokenData(16)
    plain = _train(Trainer, _llama, data, tmp_path, "plain-bf16", bf16=True)
    remat = _train(RematTrainer, _llama, data, tmp_path, "remat-bf16", bf16=True, budget="95%")
    (_, la, pa), (_, lb, pb) = plain, remat
    assert len(la) == len(lb) >= 4 and all(abs(a - b) <= 1e-3 * abs(a) for a, b in zip(la, lb)), (la, lb)
    for k in pa:  # AdamW normalises each element's step: compare whole tensors, not elements
        assert float((pa[k] - pb[k]).norm() / pa[k].norm()) < 1e-2, k
    r = _within_budget(remat[0])
    assert r.precision == "bf16" and sum(r.low_precision_ops.values()) > 0
    assert all(p.dtype == torch.float32 for p in remat[2].values())


def test_optimizer_in_remat_options_is_refused(tmp_path):
    with pytest.raises(TypeError, match="optimizer="):
        RematTrainer(model=_llama(), args=_args(tmp_path, "o"), train_dataset=TokenData(4),
                     remat_options=dict(optimizer=None))


def test_custom_loss_is_refused(tmp_path):
    with pytest.raises(NotImplementedError, match="label_smoothing_factor"):
        RematTrainer(model=_llama(), args=_args(tmp_path, "ls", label_smoothing_factor=0.1),
                     train_dataset=TokenData(4))
