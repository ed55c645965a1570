"""The activation plan: the problem, the MILP solver and the forecast; they build the engine's ``Schedule``
(no CUDA here)."""

from lightning_lazytrain.engine.plan import HOMES, Schedule

from .build import build_problem
from .milp import InfeasibleScheduleError, min_stored_bytes, precheck, solve
from .problem import ScheduleProblem
from .profile import Profile, cache_key, cache_path, measure_disk, profile_model

__all__ = [
    "HOMES",
    "InfeasibleScheduleError",
    "Schedule",
    "ScheduleProblem",
    "min_stored_bytes",
    "precheck",
    "solve",
    "Profile",
    "build_problem",
    "cache_key",
    "cache_path",
    "measure_disk",
    "profile_model",
]
