"""Started in every process of the PPO runs (the driver and each Ray worker) through PYTHONPATH. OpenRLHF 0.8.5's
Ray code calls torch.cuda itself, outside the strategy; on a machine without a GPU these two calls stand in."""

import torch


class _CPU(str):
    """ "cpu" wherever a tensor moves to the device, but "0" inside f"cuda:{...}": NaiveReplayBuffer (replay_buffer.py)
    builds torch.device(f"cuda:{torch.cuda.current_device()}") at start-up, a device that PPO never moves to."""

    def __format__(self, spec):
        return "0"


torch.cuda.current_device = lambda: _CPU("cpu")  # the trainers and actors move batches with it
torch.cuda.synchronize = lambda device=None: None  # after each fit and barrier; nothing runs asynchronously on a CPU
