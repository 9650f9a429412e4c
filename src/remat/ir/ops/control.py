"""Control flow, calls and explicit memory management. Their structure (successors, callee)
is checked by the verifier, which knows the enclosing function and module."""
from __future__ import annotations

from ..opdef import Attr, OpDef, declare
from ._util import no_flops


def _no_results(types, attrs):
    return ()


declare(OpDef("return", None, (), _no_results, frozenset({"terminator", "effect", "control"}), num_results=0,
              min_operands=0, flops=no_flops, doc="return values from the function"))
declare(OpDef("br", 0, (), _no_results, frozenset({"terminator", "effect", "control"}), num_results=0,
              flops=no_flops, doc="jump to a block, passing its arguments"))


def _cond_br_infer(types, attrs):
    (c,) = types
    if c.dtype.value != "bool" or c.rank != 0:
        raise TypeError(f"'cond_br' condition must be bool[], got {c}")
    return ()


declare(OpDef("cond_br", 1, (), _cond_br_infer, frozenset({"terminator", "effect", "control"}), num_results=0,
              flops=no_flops, doc="jump to the first block if the condition holds, else the second"))


def _call_infer(types, attrs):
    raise TypeError("'call' result types come from the callee's signature")


declare(OpDef("call", None, (Attr("callee", "str"),), _call_infer, frozenset({"control"}), num_results=-1, min_operands=0,
              flops=no_flops, doc="call a function of the module"))
declare(OpDef("free", None, (), _no_results, frozenset({"effect", "control"}), num_results=0,
              flops=no_flops, doc="release the operands' buffers now (their last use)"))
