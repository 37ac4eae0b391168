"""The launcher: starts one `engine serve` process per tensor-parallel rank, waits until every one
answers Health, supervises them (stop on a signal, stop or restart on a failure).

`python -m launcher --help` lists the flags; DESIGN.md section 1 places it in the system.
"""
