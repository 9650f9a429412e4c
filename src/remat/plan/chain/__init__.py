"""Checkpointing for chains (the thesis): cost model, solvers, executor and the PyTorch API.

    costs -> solvers.solve(costs, budget, method) -> Plan -> executor.compile_schedule -> VM
"""
from .checkpointer import SequentialCheckpointer
from .planner import ChainPlanner, Policy
from .costs import BudgetTooSmall, ChainCosts
from .curve import curve_main, plot_curve, tradeoff_curve
from .schedule import B, F, FT, Free, Plan, evaluate
from .solvers import minimum_budget, solve, solve_thesis

__all__ = ["B", "BudgetTooSmall", "ChainCosts", "ChainPlanner", "F", "FT", "Free", "Plan", "Policy", "SequentialCheckpointer",
           "curve_main", "minimum_budget", "plot_curve", "evaluate", "solve", "solve_thesis", "tradeoff_curve"]
