"""Graph separators: cut a (forward) DAG into a chain of blocks (thesis §5.2).

A node ``v`` is a *separator* if every path from the graph's sources to its sinks
passes through ``v``: everything after it depends on everything before it only
through ``v`` (outputs of ResNet/transformer blocks; not nodes inside a U-Net
skip span, nor one branch of a split-merge).  Checkpointing at separators is what
makes sequence (chain) rematerialization applicable to DAGs.

Algorithm, O(n + E): add a virtual source feeding every source node and a virtual
sink fed by every sink node; then every node lies on a source-sink path, all nodes
are ancestors or descendants of a separator, and in any topological order ``v`` is
a separator iff no edge jumps over its position (an edge ``a -> b`` with
``pos(a) < pos(v) < pos(b)`` would be a path avoiding ``v``, and without such an
edge every path must step on ``v``).  Input nodes (parameters, data) are excluded
from the criterion, so parameters read by many layers do not hide separators.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from .graph import Graph

__all__ = ["find_separators", "partition_blocks"]


def _considered(graph: Graph, nodes: Iterable[int] | None, data_inputs: Iterable[int] | None) -> list[int]:
    """Non-input nodes taking part in the separation criterion (ascending)."""
    comp = set(graph.compute_nodes)
    sel = sorted(comp if nodes is None else set(nodes) & comp)
    if data_inputs is not None:
        # drop parameter-only nodes (no data input among their ancestors)
        data = set(data_inputs)
        depends = [False] * len(graph)
        for i, nd in enumerate(graph):
            depends[i] = i in data or any(depends[j] for j in nd.inputs)
        sel = [v for v in sel if depends[v]]
    return sel


def find_separators(
    graph: Graph,
    nodes: Sequence[int] | None = None,
    *,
    data_inputs: Iterable[int] | None = None,
) -> list[int]:
    """Separator nodes of the DAG, in topological order.

    ``nodes``: restrict to the induced subgraph of these node indices (e.g. the
    forward part of a training graph; backward nodes read forward activations and
    would otherwise connect everything).  Input nodes are always excluded.
    ``data_inputs``: indices of the data inputs; if given, nodes that depend only on
    parameters (e.g. a transposed weight) are excluded too.
    """
    sel = _considered(graph, nodes, data_inputs)
    if not sel:
        return []
    pos = {v: k for k, v in enumerate(sel)}  # index order restricted to sel: topological
    m = len(sel)
    has_pred = [False] * m
    has_succ = [False] * m
    # cover[k] > 0: some edge jumps over position k (difference array over positions)
    diff = [0] * (m + 2)

    def jump(a: int, b: int) -> None:
        """Edge from position a to position b (a < b; -1 = source, m = sink)."""
        if b - a > 1:
            diff[a + 1] += 1
            diff[b] -= 1

    for v in sel:
        for u in graph[v].inputs:
            if u in pos:
                jump(pos[u], pos[v])
                has_pred[pos[v]] = True
                has_succ[pos[u]] = True
    for k in range(m):
        if not has_pred[k]:
            jump(-1, k)  # virtual source -> source node
        if not has_succ[k]:
            jump(k, m)  # sink node -> virtual sink
    seps: list[int] = []
    cover = 0
    for k in range(m):
        cover += diff[k]
        if cover == 0:
            seps.append(sel[k])
    return seps


def partition_blocks(
    graph: Graph,
    nodes: Sequence[int] | None = None,
    *,
    data_inputs: Iterable[int] | None = None,
) -> list[list[int]]:
    """Partition the considered nodes into a chain of blocks.

    Block ``k`` holds the nodes after separator ``k-1`` up to and including
    separator ``k``; a final block holds the nodes after the last separator (if
    any).  Nodes excluded as parameter-only (see ``data_inputs``) join the block of
    their first consumer among the considered nodes (else the last block).  Input
    nodes are not part of any block.  Every block is a list of node indices in
    topological order; consecutive blocks communicate only through the separator.
    """
    comp = set(graph.compute_nodes)
    universe = sorted(comp if nodes is None else set(nodes) & comp)
    sel = _considered(graph, universe, data_inputs)
    if not sel:
        return [universe] if universe else []
    seps = set(find_separators(graph, sel))
    blocks: list[list[int]] = [[]]
    block_of: dict[int, int] = {}
    for v in sel:
        blocks[-1].append(v)
        block_of[v] = len(blocks) - 1
        if v in seps:
            blocks.append([])
    if not blocks[-1]:
        blocks.pop()
    # parameter-only nodes go with their first considered consumer
    cons = graph.consumers
    for v in reversed([v for v in universe if v not in block_of]):
        firsts = [block_of[w] for w in cons[v] if w in block_of]
        b = min(firsts) if firsts else len(blocks) - 1
        block_of[v] = b
        blocks[b].append(v)
    return [sorted(b) for b in blocks]
