"""A module whose import ends the process that imports it: what a fork server that cannot start
looks like (tests/test_isolation.py preloads it). Never imported by anything else."""

import os

os._exit(7)
