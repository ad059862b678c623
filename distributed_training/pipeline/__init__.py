"""Pipeline parallelism from scratch: schedules as data (and their simulator); see docs/pipeline.md."""

from .schedules import Action, ScheduleError, Simulation, bubble_formula, build_schedule, simulate, stage_of

__all__ = ["Action", "ScheduleError", "Simulation", "bubble_formula", "build_schedule", "simulate", "stage_of"]
