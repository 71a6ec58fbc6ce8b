"""How processes start: schedulers (local, Slurm) and the worker registry. Knows nothing about RL."""
