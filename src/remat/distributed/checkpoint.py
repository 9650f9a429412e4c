"""Checkpoints of a compiled step, sharded under ZeRO: each rank saves its shard of the optimizer
state plus the metadata to reassemble it, and a run resumes with identical results."""
from __future__ import annotations

from typing import Any

FORMAT = "remat.TrainStep/1"


def state_dict(step) -> dict[str, Any]:
    """This rank's training state: parameters, buffers, optimizer state (its shards under ZeRO),
    the optimizer step count, the dropout seed counter (and torch's random state when the step draws
    its seeds from it), the fp16 loss scale, and the sharding metadata. Tensors are copies.
    ``step``: a compiled step's binding (``remat.train.binding.Binding``)."""
    import torch

    dp = step.dp
    names = step.imported.param_names
    opt_steps = step.optimizer_steps()
    sd: dict[str, Any] = {
        "format": FORMAT,
        "data_parallel": None if dp is None else dp.mode,
        "world_size": 1 if dp is None else dp.world,
        "rank": 0 if dp is None else dp.rank,
        "steps": opt_steps,
        "seed_step": step.calls,
        # The dropout seeds' source when the step draws them from torch's generator (seed=None).
        "rng_state": torch.get_rng_state() if step.imported.has_seed and step.seed is None else None,
        "loss_scale": (step.loss_scale, step.growth_tracker) if step.loss_scaled else None,  # fp16: GradScaler's state
        "params": {n: p.detach().clone() for n, p in zip(names, step.params)},
        "buffers": {n: b.detach().clone() for n, b in step.model.named_buffers()},
        "optimizer_state": {},
        "shards": {},
    }
    if step.updates:
        for n, p, u, ts in zip(names, step.params, step.updates, step.state):
            sd["optimizer_state"][n] = {k: t.detach().clone() for k, t in zip(u.state_keys, ts)}
            if dp is not None and dp.shards_state:
                sh = dp.shard(p.numel())
                sd["shards"][n] = {"numel": sh.numel, "size": sh.size, "offset": sh.offset, "shape": list(p.shape)}
    with torch.no_grad():
        return sd


def load_state_dict(step, sd: dict[str, Any]) -> None:
    """Restore ``state_dict(step)`` output into the step's own tensors, in place.

    Raises ValueError when the checkpoint was made for another mode, world size, rank or model."""
    import torch

    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        raise ValueError(f"not a remat training-step checkpoint (expected format {FORMAT!r})")
    dp = step.dp
    want = (None if dp is None else dp.mode, 1 if dp is None else dp.world, 0 if dp is None else dp.rank)
    got = (sd["data_parallel"], sd["world_size"], sd["rank"])
    if want != got:
        raise ValueError(f"checkpoint is for data_parallel={got[0]!r}, world size {got[1]}, rank {got[2]}; this step "
                         f"is data_parallel={want[0]!r}, world size {want[1]}, rank {want[2]} (reassemble the shards "
                         "with remat.distributed.checkpoint.reassemble to change the layout)")
    names = step.imported.param_names
    if list(sd["params"]) != list(names):
        raise ValueError(f"checkpoint parameters {list(sd['params'])} do not match the model's {list(names)}")
    with torch.no_grad():
        for n, p in zip(names, step.params):
            p.copy_(sd["params"][n])
        own = dict(step.model.named_buffers())
        for n, t in sd["buffers"].items():
            own[n].copy_(t)
        if step.updates:
            if dp is None or not dp.shards_state:
                step.bind_state(step.state)
                for p, u in zip(step.params, step.updates):
                    if "step" in step.optimizer.state[p]:
                        step.optimizer.state[p]["step"].fill_(sd["steps"])
            else:
                dp.steps = int(sd["steps"])
            for n, u, ts in zip(names, step.updates, step.state):
                for k, t in zip(u.state_keys, ts):
                    src = sd["optimizer_state"][n][k]
                    if src.shape != t.shape:
                        raise ValueError(f"optimizer state {n}.{k}: checkpoint has shape {list(src.shape)}, the "
                                         f"step {list(t.shape)}")
                    t.copy_(src)
    step.calls = int(sd["seed_step"])
    if sd.get("rng_state") is not None:
        torch.set_rng_state(sd["rng_state"])
    if step.loss_scaled and sd.get("loss_scale") is not None:
        step.loss_scale, step.growth_tracker = float(sd["loss_scale"][0]), int(sd["loss_scale"][1])


def reassemble(state_dicts: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The full optimizer state per parameter from every rank's ZeRO checkpoint (any order)."""
    import torch

    sds = sorted(state_dicts, key=lambda s: s["rank"])
    if [s["rank"] for s in sds] != list(range(sds[0]["world_size"])):
        raise ValueError(f"need one checkpoint per rank 0..{sds[0]['world_size'] - 1}, got ranks {[s['rank'] for s in sds]}")
    out: dict[str, dict[str, Any]] = {}
    for n, meta in sds[0]["shards"].items():
        out[n] = {k: torch.cat([s["optimizer_state"][n][k] for s in sds])[:meta["numel"]].reshape(meta["shape"])
                  for k in sds[0]["optimizer_state"][n]}
    return out
