"""Control-flow facts of one function: predecessors, reachability and dominance.

Dominators are computed with the iterative algorithm of Cooper, Harvey and Kennedy ("A Simple,
Fast Dominance Algorithm", 2001): immediate dominators over a reverse postorder, intersected by
walking up the tree. It converges in a few passes on the graphs the IR builds (one pass for a
chain or a loop nest without irreducible edges), so the whole analysis is linear in the function
in practice. ``dominates(a, b)`` is then an O(1) check of the dominator tree's pre/post numbers.
"""
from __future__ import annotations

from .core import Block, Function


def successors(b: Block) -> list[Block]:
    """The blocks ``b``'s terminator branches to (none when it has no terminator)."""
    t = b.terminator
    return [s.block for s in t.successors] if t else []


def predecessors(f: Function) -> dict[Block, list[Block]]:
    """Every block of ``f`` to the blocks of ``f`` that branch to it (in block order)."""
    preds: dict[Block, list[Block]] = {b: [] for b in f.blocks}
    for b in f.blocks:
        for s in successors(b):
            if s in preds:
                preds[s].append(b)
    return preds


def reachable(f: Function) -> set[Block]:
    """The blocks of ``f`` reachable from the entry block (a branch out of ``f``, which the
    verifier reports, is not followed)."""
    return set(reverse_postorder(f))


def reverse_postorder(f: Function) -> list[Block]:
    """The reachable blocks in reverse postorder of a depth-first walk from the entry (iterative,
    so a chain of any length does not hit Python's recursion limit)."""
    if not f.blocks:
        return []
    own = set(f.blocks)
    order: list[Block] = []
    seen = {f.entry}
    stack: list[tuple[Block, list[Block]]] = [(f.entry, successors(f.entry))]
    while stack:
        b, todo = stack[-1]
        while todo:
            s = todo.pop(0)
            if s not in seen and s in own:
                seen.add(s)
                stack.append((s, successors(s)))
                break
        else:
            stack.pop()
            order.append(b)
    order.reverse()
    return order


class DominatorTree:
    """Immediate dominators of the reachable blocks of a function, with O(1) dominance queries."""

    def __init__(self, f: Function):
        self.order = reverse_postorder(f)
        index = {b: i for i, b in enumerate(self.order)}
        preds = predecessors(f)
        idom: list[int] = [-1] * len(self.order)  # by reverse-postorder index; -1 = not yet known
        if self.order:
            idom[0] = 0

        def intersect(a: int, b: int) -> int:
            while a != b:
                while a > b:
                    a = idom[a]
                while b > a:
                    b = idom[b]
            return a

        changed = True
        while changed:
            changed = False
            for i in range(1, len(self.order)):
                new = -1
                for p in preds[self.order[i]]:
                    j = index.get(p)
                    if j is None or idom[j] < 0:
                        continue  # unreachable predecessor, or not processed yet
                    new = j if new < 0 else intersect(j, new)
                if new != idom[i]:
                    idom[i], changed = new, True
        self.idom: dict[Block, Block | None] = {
            b: (None if i == 0 else self.order[idom[i]]) for i, b in enumerate(self.order)}
        self.children: dict[Block, list[Block]] = {b: [] for b in self.order}
        for b, d in self.idom.items():
            if d is not None:
                self.children[d].append(b)
        # Pre/post numbers of the tree: a dominates b iff a's interval contains b's.
        self._pre: dict[Block, int] = {}
        self._post: dict[Block, int] = {}
        if self.order:
            n = 0
            stack: list[tuple[Block, int]] = [(self.order[0], 0)]
            while stack:
                b, k = stack.pop()
                if k == 0:
                    self._pre[b] = n
                    n += 1
                kids = self.children[b]
                if k < len(kids):
                    stack.append((b, k + 1))
                    stack.append((kids[k], 0))
                else:
                    self._post[b] = n
                    n += 1

    def __contains__(self, b: Block) -> bool:
        """Whether ``b`` is reachable (only reachable blocks are in the tree)."""
        return b in self._pre

    def dominates(self, a: Block, b: Block) -> bool:
        """Whether every path from the entry to ``b`` passes through ``a`` (a block dominates itself).
        False when either block is unreachable."""
        if a not in self._pre or b not in self._pre:
            return False
        return self._pre[a] <= self._pre[b] and self._post[b] <= self._post[a]

    def dominators(self, b: Block) -> list[Block]:
        """``b`` and its dominators up to the entry block (empty when ``b`` is unreachable)."""
        out: list[Block] = []
        cur: Block | None = b if b in self._pre else None
        while cur is not None:
            out.append(cur)
            cur = self.idom[cur]
        return out


def dominators(f: Function) -> dict[Block, set[Block]]:
    """Dominator sets of the reachable blocks (each block included in its own set).

    The sets are as large as the tree is deep; consumers that only ask "does a dominate b" should
    use :class:`DominatorTree` instead, which answers in O(1)."""
    tree = DominatorTree(f)
    return {b: set(tree.dominators(b)) for b in f.blocks if b in tree}
