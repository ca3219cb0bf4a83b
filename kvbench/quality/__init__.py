"""Quality next to speed: data, training and evaluation, and the fidelity of what was timed."""
