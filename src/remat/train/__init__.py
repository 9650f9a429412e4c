"""Training steps: training-graph generation, optimizer updates in the IR, ``remat.compile``."""
from .api import Report, TrainStep, compile

__all__ = ["Report", "TrainStep", "compile"]
