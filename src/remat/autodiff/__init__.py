"""Reverse-mode automatic differentiation by source transformation.

``differentiate(module)`` (the pass ``grad``) turns gradient declarations into ordinary IR
functions built from the per-op VJP rules declared beside each op in ``remat.ir.ops``;
``remat.grad`` / ``remat.value_and_grad`` (in :mod:`remat.autodiff.api`) do the same for staged
DSL functions.
"""
from .transform import ADJOINT_POLICIES, DifferentiationError, differentiate, gradient_function, vjp_rule
from .joint import joint

__all__ = ["ADJOINT_POLICIES", "DifferentiationError", "differentiate", "gradient_function",
           "joint", "vjp_rule"]
