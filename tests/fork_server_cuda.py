"""Imported by a fork server (tests/test_isolation.py preloads it): makes torch say CUDA is
initialised in that process, as an import that touched CUDA would leave it. Never imported by
anything else."""

import torch

torch.cuda.is_initialized = lambda: True
