"""The typed SSA tensor IR: types, op declarations, structure, text format and verifier.

This package imports nothing else of remat.
"""
from . import ops  # noqa: F401  (registers every op)
from .core import Block, BlockArg, Builder, Function, GradientSpec, Instruction, Loc, Module, OpResult, Successor, Value
from .opdef import OPS, Attr, OpDef, Sample, declare, def_vjp, get_op
from .parser import ParseError, parse
from .printer import print_function, print_module
from .types import DType, TensorType, broadcast_shapes, promote
from .verifier import VerificationError, verify

__all__ = [
    "Attr", "Block", "BlockArg", "Builder", "DType", "Function", "GradientSpec", "Instruction", "Loc", "Module", "OPS",
    "OpDef", "OpResult", "ParseError", "Sample", "Successor", "TensorType", "Value", "VerificationError",
    "broadcast_shapes", "declare", "def_vjp", "get_op", "parse", "print_function", "print_module", "promote", "verify",
]
