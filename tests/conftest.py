"""Shared test setup: one torch thread (2-core CI box; more threads only contend)."""

import torch

torch.set_num_threads(1)
