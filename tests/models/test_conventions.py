"""Hugging Face conventions with a loss function: keyword inputs (with an attention mask: the
causal-mask code of GPT-2 and Llama uses ``index.Tensor`` with several index tensors and
``cumsum``), ``loss_fn`` applied to the output's ``logits``, targets named after the loss's
parameter; one SGD step matches eager."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import remat

tf = pytest.importorskip("transformers")


def _ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _causal_lm(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=500, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
        return tf.GPT2LMHeadModel(cfg).train()
    cfg = tf.LlamaConfig(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False)
    return tf.LlamaForCausalLM(cfg).train()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_loss_fn_on_logits_with_keyword_inputs_and_mask_matches_eager(name):
    model = _causal_lm(name)
    ids, y = torch.randint(0, 500, (2, 32)), torch.randint(0, 500, (2, 32))
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, :5] = 0  # left padding in the second row
    eager = copy.deepcopy(model)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    step = remat.compile(model, dict(input_ids=ids, attention_mask=mask, target=y), _ce,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    got = step(attention_mask=mask, target=y, input_ids=ids)  # keyword order is free
    loss = _ce(eager(input_ids=ids, attention_mask=mask).logits, y)
    loss.backward()
    opt_e.step()
    want = loss.detach()
    assert abs(float(got) - float(want)) <= 1e-5 * max(1.0, abs(float(want)))
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-5)


def test_model_output_without_loss_says_to_pass_labels():
    from remat.frontend.torch_import import ModelOutputError  # not through ``remat.``: nothing may have imported it yet

    model = _causal_lm("gpt2")
    with pytest.raises(ModelOutputError, match=r"without 'loss' \(fields: logits\).*labels="):
        remat.compile(model, dict(input_ids=torch.randint(0, 500, (2, 8))))
