"""Bucket planning: the bucket and limit types and the linear/exponential/padding/file strategies
(core.py, ranges.py, plans.py), plans fitted to recorded traffic (fitted.py, shapes.py), and what a
trace costs a plan (trace_cost.py). Pure planning: imports only engine.config and engine.errors."""
