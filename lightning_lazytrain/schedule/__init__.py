"""The activation plan: problem, MILP solver, schedule dataclass and admission control (no CUDA here)."""

from .admission import (
    PRECISIONS,
    AdmissionError,
    AdmissionReport,
    TierUsage,
    admission_report,
    check_admission,
    host_bytes_per_param,
)
from .build import build_problem
from .milp import InfeasibleScheduleError, min_stored_bytes, precheck, solve
from .problem import ScheduleProblem
from .profile import Profile, cache_key, cache_path, measure_disk, profile_model
from .schedule import TIERS, Schedule, Transfer, all_gpu_schedule, interval_schedule

__all__ = [
    "PRECISIONS",
    "AdmissionError",
    "AdmissionReport",
    "TierUsage",
    "admission_report",
    "check_admission",
    "host_bytes_per_param",
    "TIERS",
    "InfeasibleScheduleError",
    "Schedule",
    "ScheduleProblem",
    "Transfer",
    "all_gpu_schedule",
    "interval_schedule",
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
