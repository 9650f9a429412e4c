"""A plain ``accelerate`` loop with a remat step: ``accelerator.prepare(model, optimizer,
dataloader)``, then the remat step instead of ``accelerator.backward``, ``clip_grad_norm_``, the
optimizer and a warmup + cosine schedule: the same losses and parameters as the eager loop."""
import pytest
import torch

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

import remat  # noqa: E402

transformers.logging.set_verbosity_error()


def _loop(use_remat: bool, steps: int = 4):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 256, (steps * 4, 32), generator=torch.Generator().manual_seed(1))
    data = [dict(input_ids=x, labels=x) for x in ids]
    accelerator = accelerate.Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    scheduler = transformers.get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=steps)
    step, losses = None, []
    for batch in loader:
        if use_remat:
            if step is None:
                step = remat.compile(accelerator.unwrap_model(model), batch, budget="92%")
            loss = step(**batch)                     # forward + backward: gradients into .grad
        else:
            loss = model(**batch).loss
            accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: p.detach().clone() for k, p in model.named_parameters()}, step


def test_accelerate_loop_matches_eager():
    eager_losses, eager_params, _ = _loop(False)
    losses, params, step = _loop(True)
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    for k, p in eager_params.items():
        assert torch.allclose(p, params[k], rtol=1e-3, atol=1e-5), k
    r = step.report()
    assert r.measured_peak == r.predicted_peak <= r.budget
