"""Training: solver types (updates.py), lr policies (lr_policy.py), the loop (solver.py), snapshots (snapshot.py)."""
from superneurons.solver.solver import Solver

__all__ = ["Solver"]
