"""Byte units shared by the planner, the schedule and the reports."""

GIB = float(1 << 30)
