"""How processes start: the CLI, launchers, deploy back-ends (local, Slurm, Ray), Redis, affinity, elastic membership."""
