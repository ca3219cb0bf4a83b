"""Running jobs: one job (device and threads once), a process per job, interrupts, claim/resume,
and what is on disk for the jobs of a sweep. The CLI (kvbench/cli*.py) wires them to Hydra and the sinks."""
