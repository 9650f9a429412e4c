"""Synthetic training graphs for the graph solvers' tests and benchmarks: a forward of conv-like
layers (chain, residual, U-Net shapes) with an autodiff-style backward, and random DAGs."""
from __future__ import annotations

import random
from dataclasses import dataclass

from remat.plan.graph import Graph, Node


@dataclass
class _FwdOp:
    """A forward op for the synthetic autodiff below."""

    name: str
    inputs: list[int]  # forward value ids (indices into the forward op list)
    bytes: int
    cost: float
    params: int = 0  # bytes of this op's parameter (0: none)
    saves_inputs: bool = True  # backward reads the forward inputs
    saves_output: bool = False  # backward reads the forward output (e.g. relu)
    passthrough: bool = False  # add/concat-like: grad flows without saved tensors
    workspace: int = 0


def _build_training_graph(data_bytes: int, ops: list[_FwdOp], rng: random.Random) -> Graph:
    """Emit forward ops + their autodiff backward as a :class:`Graph`.

    Forward value 0 is the data input (is_input, not output: freed after last use);
    parameters are pinned inputs (is_input + is_output); parameter gradients are
    outputs.  Backward: for each forward op in reverse, one node per forward input
    computing that input's gradient contribution (reads the op's output grad and
    the saved activations), contributions of multi-consumer values are accumulated.
    """
    g = Graph()
    fwd_idx: list[int] = [g.add_input("x", data_bytes)]  # forward value id -> node index
    params: dict[int, int] = {}
    for k, op in enumerate(ops, start=1):
        ins = [fwd_idx[u] for u in op.inputs]
        if op.params:
            params[k] = g.add_input(f"W_{op.name}", op.params, is_output=True)
            ins.append(params[k])
        fwd_idx.append(
            g.add_node(op.name, op.cost, op.bytes, ins, workspace=op.workspace)
        )
    last = fwd_idx[-1]
    loss = g.add_node("loss", 1e-6, 4, [last])
    # grad contributions per forward value id
    contrib: dict[int, list[int]] = {len(ops): [g.add_node("d_loss", 1e-6, ops[-1].bytes, [loss])]}
    value_bytes = [data_bytes] + [op.bytes for op in ops]
    for k in range(len(ops), 0, -1):
        op = ops[k - 1]
        parts = contrib.pop(k, [])
        if not parts:
            continue  # value does not influence the loss
        if len(parts) == 1:
            gk = parts[0]
        else:
            gk = g.add_node(f"d_{op.name}_acc", 1e-6 * len(parts), op.bytes, parts)
        saved = [fwd_idx[u] for u in op.inputs] if op.saves_inputs else []
        if op.saves_output:
            saved.append(fwd_idx[k])
        if op.params:
            saved_p = [params[k]]
            g.add_node(
                f"dW_{op.name}", op.cost * rng.uniform(0.9, 1.1), op.params,
                [gk] + [fwd_idx[u] for u in op.inputs], is_output=True,
            )
        else:
            saved_p = []
        for u in op.inputs:
            if u == 0:
                continue  # no gradient w.r.t. the data
            if op.passthrough:
                contrib.setdefault(u, []).append(gk)
                continue
            d = g.add_node(
                f"d_{op.name}->{ops[u - 1].name}",
                op.cost * rng.uniform(0.9, 1.1),
                value_bytes[u],
                [gk] + saved + saved_p,
            )
            contrib.setdefault(u, []).append(d)
    return g


def synthetic_training_graph(
    kind: str,
    n: int,
    seed: int | None = 0,
    *,
    act_bytes: int = 1 << 20,
    param_bytes: int = 1 << 12,
    cost: float = 1e-3,
) -> Graph:
    """A synthetic training graph (forward + autodiff-style backward).

    kind:
      * ``"chain"``: n conv-like layers in a chain (relu fused).
      * ``"residual"``: n residual blocks ``a_k = a_{k-1} + relu(conv(a_{k-1}))``.
      * ``"unet"``: a U-Net with ``n`` levels (2 convs per level, downsampling
        halves the bytes, decoder levels add the encoder skip).
    Sizes/costs are jittered by +-30% with ``seed`` (None: no jitter).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(seed)

    def jit(x: float) -> float:
        return x if seed is None else x * rng.uniform(0.7, 1.3)

    ops: list[_FwdOp] = []

    def add(name: str, inputs: list[int], b: float, c: float, **kw: object) -> int:
        ops.append(_FwdOp(name, inputs, max(1, int(jit(b))), jit(c), **kw))  # type: ignore[arg-type]
        return len(ops)

    if kind == "chain":
        v = 0
        for i in range(n):
            v = add(f"conv{i}", [v], act_bytes, cost, params=param_bytes, saves_output=True)
    elif kind == "residual":
        v = add("stem", [0], act_bytes, cost, params=param_bytes)
        for i in range(n):
            h = add(f"b{i}.conv", [v], act_bytes, cost, params=param_bytes)
            r = add(f"b{i}.relu", [h], act_bytes, cost * 0.1, saves_inputs=False, saves_output=True)
            v = add(f"b{i}.add", [r, v], act_bytes, cost * 0.05, passthrough=True)
    elif kind == "unet":
        v = 0
        skips: list[tuple[int, float]] = []
        b = float(act_bytes)
        for lvl in range(n):
            v = add(f"enc{lvl}.conv1", [v], b, cost, params=param_bytes)
            v = add(f"enc{lvl}.conv2", [v], b, cost, params=param_bytes)
            skips.append((v, b))
            if lvl < n - 1:
                v = add(f"enc{lvl}.down", [v], b / 2, cost * 0.1, saves_inputs=True)
                b /= 2
        for lvl in range(n - 2, -1, -1):
            sv, sb = skips[lvl]
            v = add(f"dec{lvl}.up", [v], sb, cost * 0.2)
            v = add(f"dec{lvl}.skip", [v, sv], sb, cost * 0.05, passthrough=True)
            v = add(f"dec{lvl}.conv", [v], sb, cost, params=param_bytes)
    else:
        raise ValueError(f"unknown kind {kind!r} (expected 'chain', 'residual' or 'unet')")
    return _build_training_graph(max(1, int(jit(act_bytes))), ops, rng)


def random_graph(
    n: int,
    seed: int,
    *,
    n_inputs: int = 1,
    max_fanin: int = 2,
    max_bytes: int = 10,
    max_cost: int = 5,
    p_nonrecomputable: float = 0.0,
    p_workspace: float = 0.0,
) -> Graph:
    """A small random DAG for tests: ``n_inputs`` inputs, ``n`` computed nodes with
    integer bytes/costs; every sink is an output; some inputs pinned at random."""
    rng = random.Random(seed)
    g = Graph()
    for i in range(n_inputs):
        g.add_input(f"in{i}", rng.randint(1, max_bytes), is_output=rng.random() < 0.3)
    for i in range(n):
        total = len(g)
        k = rng.randint(1, min(max_fanin, total))
        # bias towards recent nodes so the DAG is deep rather than flat
        cands = sorted(rng.sample(range(total), min(total, k + 2)), reverse=True)
        ins = sorted(set(cands[:k]))
        g.add_node(
            f"n{i}",
            float(rng.randint(1, max_cost)),
            rng.randint(1, max_bytes),
            ins,
            recomputable=rng.random() >= p_nonrecomputable,
            workspace=rng.randint(1, max_bytes) if rng.random() < p_workspace else 0,
        )
    # sinks are outputs; plus an occasional extra output
    cons = g.consumers
    out = Graph()
    for i, nd in enumerate(g):
        is_out = nd.is_output or (not nd.is_input and (not cons[i] or rng.random() < 0.1))
        out._append(
            Node(nd.name, nd.cost, nd.bytes, nd.inputs, nd.is_input, is_out, nd.recomputable, nd.workspace)
        )
    return out
