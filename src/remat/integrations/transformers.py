"""``RematTrainer``: a Hugging Face ``transformers.Trainer`` whose training step is a remat step.

    from remat.integrations.transformers import RematTrainer

    trainer = RematTrainer(model=model, args=TrainingArguments(...), train_dataset=ds, budget="60%")
    trainer.train()
    print(trainer.remat_report())

Only the forward and backward of each batch change: they run as a step compiled by
:func:`remat.compile` under ``budget`` (without ``optimizer=``, so the step adds its gradients into
each parameter's ``.grad``). Everything else is the Trainer's own: the optimizer and its learning-rate
schedule (``lr_scheduler_type``, ``warmup_steps``), ``max_grad_norm`` clipping,
``gradient_accumulation_steps``, logging, evaluation (eager, under ``torch.no_grad``), checkpoint
save and resume.

Importing this module imports ``transformers``; ``import remat`` does not.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer

from ..train import api
from ..train.api import TrainStep

_UNSUPPORTED_ARGS = {
    ("fp16",): "mixed precision in float16 (fp16=True; bf16=True is supported)",
    # transformers sets each of these from the other (gradient_checkpointing is the older name)
    ("activation_checkpointing", "gradient_checkpointing"): "activation checkpointing (remat plans what to "
                                                             "recompute itself)",
}


class _ScaledLoss(torch.nn.Module):
    """The model's own loss times ``loss_scale`` (a 0-d tensor input of the step: the Trainer's
    gradient-accumulation and multi-process factors change from call to call without a recompile)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, loss_scale: torch.Tensor, **inputs: Any) -> torch.Tensor:
        out = self.model(**inputs)
        loss = out["loss"] if isinstance(out, dict) else out[0]
        return loss * loss_scale


class RematTrainer(Trainer):
    """A ``transformers.Trainer`` whose forward and backward run as a remat step under ``budget``.

    ``budget``: as :func:`remat.compile`'s (bytes, ``"1.5GiB"``, ``"60%"`` of the unconstrained
    peak, a fraction, or None for no recomputation). ``remat_options``: further keyword options
    of :func:`remat.compile` (``solver=``, ``seed=``, ``algorithms=``, ...; not ``optimizer=``: the
    Trainer's optimizer updates the parameters). Every other argument is the Trainer's.

    The step is compiled on the first training batch (the model in train mode), on the model's own
    ``loss`` for the batch's keyword inputs (``input_ids``, ``attention_mask``, ``labels``, ...),
    times the factor the Trainer applies to it: ``1 / gradient_accumulation_steps`` for a per-batch
    mean, or 1 when the model normalises by ``num_items_in_batch`` (the tokens of the whole
    accumulated batch, which the step then takes as an input). The gradients and the returned loss
    are therefore those of the plain Trainer's ``training_step``, up to summation order.

    Shapes: every distinct set of input shapes compiles a step of its own, under the same budget
    (seconds each, then cached; ``remat_step.report().shapes_cached`` counts them). With dynamic
    padding that is one compile per distinct padded length, so pad to a few lengths: a data
    collator with ``pad_to_multiple_of=`` (64, say) compiles at most ``max_length / 64`` steps,
    ``padding="max_length"`` one. A smaller last batch adds one more (or set
    ``dataloader_drop_last=True``). Every shape gets the same budget in bytes: a relative one
    (``"60%"``) is resolved against the first batch's unconstrained peak, so when lengths vary give
    it in bytes (a longer batch that cannot fit raises ``remat.BudgetTooSmall``).

    Dropout draws its seeds from PyTorch's generator (the Trainer's seed governs it), but its masks
    are remat's own (replayed exactly when recomputed), so with dropout the losses are
    statistically, not bitwise, the plain Trainer's. ``bf16=True`` compiles the step with ``precision="bf16"`` (the forward and loss under
    bf16 autocast, fp32 master weights), as the plain Trainer's autocast computes it. Not supported
    (refused with ``NotImplementedError`` when the Trainer is built): ``fp16`` (remat scales the loss inside
    its fused optimizer step, and the Trainer owns its optimizer), ``gradient_checkpointing``, a ``compute_loss_func``, label smoothing and an
    overridden ``compute_loss``; a run on more than one process or device.
    """

    def __init__(self, *args: Any, budget: Any = None, remat_options: dict[str, Any] | None = None, **kwargs: Any):
        options = dict(remat_options or {})
        if "optimizer" in options:
            raise TypeError("RematTrainer: remat_options cannot hold optimizer=: the Trainer's optimizer updates "
                            "the parameters from the gradients the remat step leaves in .grad")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            _check_args(training_args)
        super().__init__(*args, **kwargs)
        _check_args(self.args)
        _warn_torch_compile(self.args)
        self._check_supported()
        self.budget, self.remat_options = budget, options
        self._remat_step: TrainStep | None = None

    # ------------------------------------------------------------------ the step
    @property
    def remat_step(self) -> TrainStep | None:
        """The compiled remat step (None before the first training batch)."""
        return self._remat_step

    def remat_report(self):
        """The compiled step's :class:`remat.train.report.Report` (plan, predicted and measured peak)."""
        if self._remat_step is None:
            raise RuntimeError("RematTrainer: no remat step yet; it is compiled on the first training batch "
                               "(call trainer.train() first)")
        return self._remat_step.report()

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """Forward and backward of one batch as a remat step; returns the loss as the Trainer's
        ``training_step`` does (divided by the accumulation steps unless the model normalised it
        by ``num_items_in_batch``), and leaves its gradient added into each parameter's ``.grad``."""
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = dict(self._prepare_inputs(inputs))
        scale = 1.0  # the factor the Trainer's training_step applies to compute_loss's loss
        scaled_for_ga = self.loss_is_scaled_for_ga
        if scaled_for_ga is None:
            scaled_for_ga = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            if not torch.is_tensor(num_items_in_batch):
                num_items_in_batch = torch.tensor(num_items_in_batch)
            # as a float: loss / count divides in float32 either way, and float counts are one dtype
            inputs["num_items_in_batch"] = num_items_in_batch.to(self.args.device, torch.float32)
        if not scaled_for_ga:
            scale /= self.current_gradient_accumulation_steps
        inputs["loss_scale"] = torch.tensor(scale, dtype=torch.float32, device=self.args.device)
        step = self._remat_step
        if step is None:
            step = self._remat_step = self._compile(model, inputs)
        return step(**inputs).detach()

    def _compile(self, model: torch.nn.Module, inputs: dict[str, Any]) -> TrainStep:
        """The remat step for this batch's keyword inputs (other shapes compile on first sight)."""
        unwrapped = self.accelerator.unwrap_model(model)
        options = dict(self.remat_options)
        if self.args.bf16:  # the Trainer's bf16=True: remat's bf16 autocast, fp32 master weights
            options.setdefault("precision", "bf16")
        step = api.compile(_ScaledLoss(unwrapped), inputs, None, budget=self.budget, **options)
        # Dropout seeds follow the step count: a resumed run continues the uninterrupted run's sequence.
        step.binding.calls = self.state.global_step * self.args.gradient_accumulation_steps
        return step

    def _check_supported(self) -> None:
        """NotImplementedError for a run on several processes or devices, and for losses other than
        the model's own ``loss`` (with one process, the Trainer's multi-process loss factors are 1)."""
        if self.args.n_gpu > 1 or self.accelerator.num_processes > 1:
            raise NotImplementedError("RematTrainer runs on one process and one device; remat's data parallelism "
                                      "is remat.compile(..., data_parallel=...) in your own loop")
        if self.compute_loss_func is not None or self.label_smoother is not None:
            raise NotImplementedError("RematTrainer trains on the model's own loss: compute_loss_func and "
                                      "label_smoothing_factor are not supported yet")
        if type(self).compute_loss is not Trainer.compute_loss:
            raise NotImplementedError(f"{type(self).__name__} overrides compute_loss: RematTrainer compiles the "
                                      "model's own loss (pass the loss's inputs as the batch's keywords instead)")


def _check_args(args) -> None:
    """NotImplementedError naming the first TrainingArguments setting the integration does not support."""
    for names, what in _UNSUPPORTED_ARGS.items():
        if any(getattr(args, name, False) for name in names):
            off = " and ".join(f"{name}=False" for name in names if hasattr(args, name))
            raise NotImplementedError(f"RematTrainer: {what} is not available yet in this integration; set {off}")


def _warn_torch_compile(args) -> None:
    """A warning that ``torch_compile=True`` compiles evaluation only (training runs as the remat step)."""
    if getattr(args, "torch_compile", False):
        import warnings

        warnings.warn("RematTrainer: torch_compile=True compiles evaluation and prediction only: training steps "
                      "run as the remat step (its own compiled program under the budget), not through "
                      "torch.compile", UserWarning, stacklevel=3)
