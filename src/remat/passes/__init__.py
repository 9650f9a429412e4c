"""IR -> IR passes (simplify, fold, cse, dce, …) and the pipeline that runs them by name."""
from .pipeline import CLEANUP, PASSES, PipelineResult, get_pass, register_pass, run_pipeline

__all__ = ["CLEANUP", "PASSES", "PipelineResult", "get_pass", "register_pass", "run_pipeline"]
