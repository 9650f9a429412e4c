"""Checkpointing for chains (the thesis): cost model, solvers, executor and the PyTorch API.

    costs -> solvers.solve(costs, budget, method) -> Solution -> executor.compile_schedule -> VM
"""
from .checkpointer import SequentialCheckpointer
from .planner import ChainPlanner
from .costs import BudgetTooSmall, ChainCosts
from .curve import curve_main, plot_curve, tradeoff_curve
from .schedule import B, F, FT, Free, evaluate_chain
from .solvers import minimum_budget, solve, solve_thesis

__all__ = ["B", "BudgetTooSmall", "ChainCosts", "ChainPlanner", "F", "FT", "Free", "SequentialCheckpointer",
           "curve_main", "evaluate_chain", "minimum_budget", "plot_curve", "solve", "solve_thesis", "tradeoff_curve"]
