"""Running jobs: one job (device and threads once), a process per job, interrupts, claim/resume,
and the sweep around them."""
