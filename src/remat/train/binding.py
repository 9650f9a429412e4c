"""The model's tensors and the optimizer's state, bound to the step program's arguments and results.

A :class:`Binding` is made once per compile (the ``bind`` stage) and used at every step: it lays the
parameters, buffers, optimizer state and step counters out in the order of the captured IR
(:class:`remat.step.Layout`), and puts the step's results back (updated buffers, ``.grad``).
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Sequence

import numpy as np

from ..step.optim import (bind_state, check_updates, init_state, steps_taken, store_params_contiguous, update_arguments,
                          update_param_types, updates_from_torch)
from ..step.program import Layout


def tensor_type(t):
    """The IR type of a torch tensor."""
    from ..runtime.vm import tensor_type_of

    return tensor_type_of(t.detach())


@dataclass(frozen=True)
class LossScaling:
    """``torch.amp.GradScaler``'s defaults: the initial scale, and its growth, backoff and interval."""

    init: float = 2.0 ** 16
    growth: float = 2.0
    backoff: float = 0.5
    interval: int = 2000


LOSS_SCALE = LossScaling()


class Binding:
    """Parameters, buffers and optimizer state of ``model`` in the order of the imported IR ``imp``.

    ``state``: each trainable parameter's optimizer state tensors (``updates[i].state_keys``), the
    optimizer's own (bound on the first successful step) or, under ZeRO, this rank's shards.
    ``calls``: steps run so far. ``seed``: None, each step's dropout seed is drawn from torch's
    global generator (:meth:`next_seed`, as eager dropout draws from it); an int, the seed of a
    step is ``seed + calls``, whatever torch's generator says."""

    def __init__(self, model, optimizer, imp, dp, seed: int | None, loss_scaled: bool = False,
                 atomic: bool = False):
        self.model, self.optimizer, self.imported, self.dp, self.seed = model, optimizer, imp, dp, seed
        # fp16: the loss scale, the forward's last input (remat.passes.loss_scale), and GradScaler's
        # count of steps since it last changed.
        self.loss_scaled = loss_scaled
        self.loss_scale, self.growth_tracker = (LOSS_SCALE.init if loss_scaled else None), 0
        self.calls = 0
        named = dict(model.named_parameters())
        self.params = [named[n] for n in imp.param_names]
        # The trainable weights the step takes OHWI (channels-last weights; remat.passes.layout).
        self.ohwi = frozenset(i for i in imp.ohwi if i < len(self.params) and self.params[i] is imp._tensors[i])
        named_b = dict(model.named_buffers())
        self.buffers_out = ([named_b[n.split(":", 1)[-1]] for n in imp.output_names[1:]]
                            if len(imp.output_names) > 1 else [])
        self.layout = Layout(len(imp.param_names), imp.state_count, imp.input_count, imp.has_seed,
                             len(imp.output_names) - 1)
        self.updates = updates_from_torch(optimizer, self.params) if optimizer is not None else None
        if self.updates:  # updated in place: contiguous (reordered in place) or refused, never a copy updated
            store_params_contiguous(self.params, imp.param_names, self.ohwi)
        self.state = init_state(optimizer, self.params, self.updates) if self.updates else []
        if self.updates:
            steps_taken(optimizer, self.params, self.updates, imp.param_names)  # stepped unequally: fail now
        if dp is not None and dp.shards_state:
            self.state = self._sharded_state()
        self.state_types = [[tensor_type(t.permute(0, 2, 3, 1) if i in self.ohwi else t) for t in ts]
                            for i, ts in enumerate(self.state)]
        # atomic=True: flat copies of each parameter and its state from just before its update
        # (step.program.backup_types), so that a step failing midway can be rolled back.
        self.backups: list[list] = []
        if atomic and self.updates:
            import torch

            self.backups = [[torch.empty(t.numel, dtype=p.dtype, device=p.device) for t in (tensor_type(p), *ts)]
                            for p, ts in zip(self.params, self.state_types)]

    def _sharded_state(self) -> list[list]:
        """ZeRO: zeros for this rank's shard of every state tensor, kept by the step (not in
        ``optimizer.state``: it holds no full-size state); ``state_dict()`` saves them."""
        import torch

        if any(self.optimizer.state.get(p) for p in self.params):
            raise ValueError(f"data_parallel={self.dp.mode!r} shards the optimizer state, but this optimizer already "
                             "has state; compile with a fresh optimizer and restore a run with step.load_state_dict()")
        return [[torch.zeros(self.dp.shard(p.numel()).size, dtype=p.dtype, device=p.device) for _ in u.state_keys]
                for p, u in zip(self.params, self.updates)]

    def extra_bytes(self) -> int:
        """Bytes the step adds to the joint: optimizer state, the step counter and hyperparameters,
        and ``atomic=True``'s backups."""
        return (sum(t.nbytes for ts in self.state_types for t in ts)
                + (sum(t.nbytes for t in update_param_types(self.updates)) if self.updates else 0)
                + sum(t.numel() * t.element_size() for ts in self.backups for t in ts))

    def optimizer_steps(self) -> int:
        """Optimizer steps taken so far (the count the next step's update continues from)."""
        if self.dp is not None and self.dp.shards_state:
            return self.dp.steps
        return steps_taken(self.optimizer, self.params, self.updates, self.imported.param_names) if self.updates else 0

    def check_optimizer(self) -> None:
        """RuntimeError when the optimizer changed what the compiled updates cannot follow
        (``remat.step.optim.check_updates``); its hyperparameters' values are read at every step.
        The parameters the step updates in place are stored contiguous again if their storage
        changed since (``p.data = p.data.t().contiguous().t()``, ``model.to(memory_format=...)``):
        the step would otherwise update a contiguous copy and lose the update
        (:func:`~remat.step.optim.store_params_contiguous`; a strided view of a larger tensor is a
        ValueError naming the parameter)."""
        check_updates(self.optimizer, self.params, self.updates)
        store_params_contiguous(self.params, self.imported.param_names, self.ohwi)

    # ------------------------------------------------------------------ arguments
    def next_seed(self) -> int | None:
        """The dropout seed of the step about to run (None: the step draws nothing): drawn from
        torch's global generator, so ``torch.manual_seed`` governs it, a recompile continues the
        sequence and a resume that restores ``torch.get_rng_state()`` continues it; with a fixed
        ``seed``, ``seed + calls``. Recomputed random ops replay their own draws from it."""
        if not self.imported.has_seed:
            return None
        if self.seed is None:
            import torch

            return int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))
        return self.seed + self.calls

    def joint_args(self, inputs: Sequence, copy: bool, seed: int | None = None) -> list:
        """The training joint's arguments: state (parameters, buffers, constants), inputs[, seed]
        (``seed``: the step's, :meth:`next_seed`; None: a fixed one that leaves torch's generator
        alone, for runs on copies such as profiling)."""
        args = self.imported.param_tensors(copy=copy) + [t.detach() if hasattr(t, "detach") else t for t in inputs]
        if self.loss_scaled:
            args.append(np.array(self.loss_scale, dtype=np.float32))
        if self.imported.has_seed:
            args.append(np.array((self.seed or 0) + self.calls if seed is None else seed, dtype=np.int64))
        return args

    def step_args(self, inputs: Sequence, copy: bool, step: int, state: list[list] | None = None,
                  seed: int | None = None) -> list:
        """The step program's arguments: the joint's, then, when the step updates the parameters, the
        optimizer state, the step count ``step`` (the optimizer step this one takes) and each param
        group's hyperparameters as they are now (a learning-rate schedule's current value)."""
        args = self.joint_args(inputs, copy, seed)
        if self.updates:
            ohwi = self.ohwi
            if ohwi:
                from ..frontend.torch_import import ohwi_copy, ohwi_view
            for i, ts in enumerate(self.state if state is None else state):
                if i in ohwi:  # the OHWI parameter's state: OHWI views too (ohwi_view)
                    args += [ohwi_copy(t) if copy else ohwi_view(t) for t in ts]
                else:
                    args += [t.detach().clone() if copy else t.detach() for t in ts]
            args += update_arguments(self.optimizer, self.updates, step)
            args += [t for ts in self.backups for t in ts]
        return args

    # ------------------------------------------------------------------ results
    def restore(self, args: list, updated: list[int]) -> None:
        """``atomic=True``: parameters ``updated`` (indices) and their optimizer state back to the
        values the step's backups hold (``args``: the step's arguments, whose views the update wrote)."""
        import torch

        n_joint = self.layout.n_args
        offsets, off = [], n_joint
        for ts in self.state:
            offsets.append(off)
            off += len(ts)
        with torch.no_grad():
            for k in updated:
                targets = [args[k]] + [args[offsets[k] + j] for j in range(len(self.state[k]))]
                for t, backup in zip(targets, self.backups[k]):
                    t.view(-1).copy_(backup)

    def next_loss_scale(self, skipped: bool) -> None:
        """GradScaler's update after a step: halve the scale when the step overflowed (skipped), double
        it after ``LOSS_SCALE.interval`` steps in a row that did not."""
        if skipped:
            self.loss_scale *= LOSS_SCALE.backoff
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == LOSS_SCALE.interval:
            self.loss_scale *= LOSS_SCALE.growth
            self.growth_tracker = 0

    def bind_state(self, state: list[list]) -> None:
        """After a successful step: the optimizer owns the state the step updated."""
        self.state = bind_state(self.optimizer, self.params, self.updates, state)

    def put_results(self, outs: Sequence, args: Sequence, keep_grads: bool) -> None:
        """The step's updated buffers into the model's, and with ``keep_grads`` its gradients into ``.grad``."""
        import torch

        with torch.no_grad():
            if self.buffers_out:  # one call for all (batch norms' statistics: a zoo U-Net's 42 copies, 77 -> 64 µs in its step)
                torch._foreach_copy_(self.buffers_out, list(outs[1:self.layout.first_grad]))
            if keep_grads:
                self._set_grads(outs, args)

    def _set_grads(self, outs: Sequence, args: Sequence) -> None:
        """Each parameter's ``.grad``: the step's gradient (added to an existing ``.grad``). A gradient
        that owns its storage alone is taken as it is, so the step's measured peak is the VM's (a copy
        of every gradient while the VM's are still referenced would add the gradients' bytes at the
        end of the step); one sharing storage with an argument, the loss, a buffer's new value or
        another gradient (a view, or one value returned twice) is copied."""
        import torch

        first = self.layout.first_grad
        taken = {t.untyped_storage().data_ptr() for t in [*args, *outs[:first]] if isinstance(t, torch.Tensor)}
        ohwi = self.ohwi
        for i, (p, g) in enumerate(zip(self.params, outs[first:])):
            if p.grad is not None:
                p.grad.add_(g.permute(0, 3, 1, 2) if i in ohwi else g)
                continue
            g = g.to(p.dtype)
            st = g.untyped_storage()
            alone = (g.numel() > 0 and g.is_contiguous() and g.storage_offset() == 0
                     and st.nbytes() == g.numel() * g.element_size() and st.data_ptr() not in taken)
            g = g if alone else g.clone()
            p.grad = g.permute(0, 3, 1, 2) if i in ohwi else g  # an OHWI gradient: the weight's, channels-last
            taken.add(st.data_ptr())
