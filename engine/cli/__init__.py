"""The engine's own commands, the top of the engine: `python -m engine serve|buckets|warmup-profile`
(main.py, buckets.py, warmup_profile.py) and the engine flags that the launcher's commands reuse.
May import any engine folder; nothing in the engine imports it."""
