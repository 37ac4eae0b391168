"""A lazy-graph simulator on the CPU (`--simulate hpu`): the CPU adapter plans, pads and marks steps
as the HPU adapter does, and a dispatch mode keys the device ops between two mark_steps into graphs
as Gaudi's lazy mode would, counting compiles and graph breaks and refusing float64 (lazy.py). The
adapter is in adapter.py; the counters every device reports, simulated or not, in counters.py."""
