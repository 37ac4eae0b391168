"""The engine's own commands, the top of the engine: `python -m engine serve|buckets|warmup-profile`
(main.py, buckets.py, warmup_profile.py), and flags.py, which builds every command line (the
router's and the launcher's too) from the knob dataclasses' fields.
May import any engine folder; nothing in the engine imports it."""
