"""Fine-tune a small Llama with LoRA (peft) under a memory budget, two ways: in the Hugging Face
Trainer (``RematTrainer``) and in a plain loop (remat step + clip_grad_norm_ + AdamW + a warmup +
cosine schedule). Random weights and generated token data: nothing is downloaded.

    python examples/finetune_lora_trainer.py            # under a minute on one core
    python examples/finetune_lora_trainer.py --quick    # a few steps of a smaller model

Needs ``transformers`` and ``peft`` (``pip install -e '.[dev]'``).
"""
from __future__ import annotations

import argparse
import tempfile

import torch


def make_model(hidden: int, layers: int, vocab: int, seed: int = 0):
    """A random-weight Llama with LoRA adapters on its attention projections (base weights frozen)."""
    import peft
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab)
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return peft.get_peft_model(transformers.LlamaForCausalLM(cfg), lora)


def make_data(n: int, length: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    """``n`` token sequences with a learnable pattern (each token is the previous one plus 1, from
    a random start), labels = inputs (the causal-LM loss shifts them)."""
    g = torch.Generator().manual_seed(1)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    ids = (start + torch.arange(length)) % vocab
    return [dict(input_ids=x, labels=x) for x in ids]


def train_with_trainer(sizes: dict, budget, steps: int, batch: int, out_dir: str):
    """The Trainer recipe (warmup + cosine, max_grad_norm=1.0, accumulation 2) in RematTrainer."""
    from transformers import TrainingArguments

    from remat.integrations.transformers import RematTrainer

    model = make_model(sizes["hidden"], sizes["layers"], sizes["vocab"])
    args = TrainingArguments(output_dir=out_dir, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no",
                             max_steps=steps, per_device_train_batch_size=batch, gradient_accumulation_steps=2,
                             learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=max(1, steps // 5),
                             max_grad_norm=1.0, seed=0, disable_tqdm=True)
    data = make_data(steps * batch * 2, sizes["length"], sizes["vocab"])
    trainer = RematTrainer(model=model, args=args, train_dataset=data, budget=budget)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, trainer.remat_report()


def train_plain_loop(sizes: dict, budget, steps: int, batch: int):
    """The same recipe as a plain PyTorch loop around a remat step (no accumulation here)."""
    from transformers import get_cosine_schedule_with_warmup

    import remat

    model = make_model(sizes["hidden"], sizes["layers"], sizes["vocab"]).train()
    data = make_data(steps * batch, sizes["length"], sizes["vocab"])
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=max(1, steps // 5),
                                                num_training_steps=steps)
    step, losses = None, []
    for inputs in loader:
        if step is None:  # compiled on the first batch; the model's own loss (labels=)
            step = remat.compile(model, inputs, budget=budget)
        loss = step(**inputs)  # forward + backward under the budget: gradients in .grad
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, step.report()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", default="80%", help="bytes, a size ('2MiB') or a percentage of the unconstrained peak")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default 20, --quick 4)")
    ap.add_argument("--quick", action="store_true", help="a smaller model and a few steps (the test runs this)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # kernels this small gain nothing from more threads (and lose on shared cores)
    sizes = (dict(hidden=64, layers=2, vocab=256, length=32) if args.quick
             else dict(hidden=128, layers=4, vocab=512, length=128))
    steps = args.steps or (4 if args.quick else 20)
    batch = 4

    with tempfile.TemporaryDirectory() as out_dir:
        trainer_losses, trainer_report = train_with_trainer(sizes, args.budget, steps, batch, out_dir)
    print("RematTrainer losses:", " ".join(f"{x:.4f}" for x in trainer_losses))
    print(trainer_report)
    loop_losses, loop_report = train_plain_loop(sizes, args.budget, steps, batch)
    print("plain loop losses:  ", " ".join(f"{x:.4f}" for x in loop_losses))
    print(loop_report)
    return dict(trainer_losses=trainer_losses, trainer_report=trainer_report, loop_losses=loop_losses,
                loop_report=loop_report)


if __name__ == "__main__":
    main()
