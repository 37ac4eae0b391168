"""Bucket planning. The entry point is plan.py (`make_plan` for every strategy, and the checks a
plan from outside must pass); grid.py holds the bucket and limit types and the linear, exponential
and padding grids (ranges.py); fitted.py and shapes.py fit plans to recorded traffic; trace_cost.py
says what a trace costs a plan. Pure planning: imports only engine.config and engine.errors."""
