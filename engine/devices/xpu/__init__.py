"""Intel XPU (Data Center GPU Max, Arc): the adapter (`adapter.py`)."""
