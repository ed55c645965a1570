"""The run's plan over the run: its solve (`solve.py`), re-plans (`replan.py`), the OOM fallback ladder and the
retry loop the strategy runs each step in (`oom_ladder.py`), and the one object that holds them and the plan half
of a checkpoint (`run_plan.RunPlan`)."""

from lightning_lazytrain.planning.oom_ladder import RUNGS, OomLadder, step_with_fallback
from lightning_lazytrain.planning.replan import LinkDrift
from lightning_lazytrain.planning.run_plan import RunPlan

__all__ = ["RUNGS", "LinkDrift", "OomLadder", "RunPlan", "step_with_fallback"]
