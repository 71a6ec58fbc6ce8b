"""hpcrl: RL training of language models on Slurm clusters."""
