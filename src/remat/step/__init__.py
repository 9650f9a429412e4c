"""The training step as IR: the training graph (forward + loss + backward, RAF §3.1) and the
optimizer updates generated in it, laid out as one function ``(params, state, inputs) -> ...``.

``remat.train`` compiles and runs such a step for a user's model; ``remat.distributed`` rewrites
it for data parallelism.
"""
from .optim import STEP_TYPE, ParamUpdate, UpdateArgs, emit_update, update_param_types
from .program import Layout, cleanup, prepare_joint, step_program, training_forward, training_graph, update_points

__all__ = ["Layout", "ParamUpdate", "STEP_TYPE", "UpdateArgs", "cleanup", "emit_update", "update_param_types", "prepare_joint", "step_program",
           "training_forward", "training_graph", "update_points"]
