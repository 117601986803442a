"""Started in every process of the PPO runs (the driver and each Ray worker) through PYTHONPATH. OpenRLHF's Ray code
(0.8.5 and 0.10.1) calls torch.cuda itself, outside the strategy; on a machine without a GPU these calls stand in.
Last, one shim for a renamed argument of torch's."""

import inspect

import torch
import torch.distributed.distributed_c10d as c10d


class _CPU(str):
    """ "cpu" wherever a tensor moves to the device, but "0" inside f"cuda:{...}": NaiveReplayBuffer (replay_buffer.py)
    builds torch.device(f"cuda:{torch.cuda.current_device()}") at start-up, a device that PPO never moves to."""

    def __format__(self, spec):
        return "0"


torch.cuda.current_device = lambda: _CPU("cpu")  # the trainers and actors move batches with it
torch.cuda.synchronize = lambda device=None: None  # after each fit and barrier; nothing runs asynchronously on a CPU
# 0.10.1's actor passes torch.cuda.current_stream() to the weight broadcast to vLLM (ppo_actor.py, _broadcast_param),
# whose stand-in (vllm-0.19/vllm/distributed/device_communicators/pynccl.py) takes no stream: there is none.
torch.cuda.current_stream = lambda device=None: None


# Not GPU-only, but torch's: OpenRLHF's init_process_group (utils/distributed_util.py), which makes the group that
# sends the actor's weights to the engine, names torch's backend_options argument by comparing version strings,
# str(torch.__version__) >= "2.6", which is False for 2.10 and later; it then passes the name torch 2.6 retired.
def _accept_pg_options(helper):
    def _new_process_group_helper(*args, **kwargs):
        if "pg_options" in kwargs:
            kwargs["backend_options"] = kwargs.pop("pg_options")
        return helper(*args, **kwargs)

    return _new_process_group_helper


if "pg_options" not in inspect.signature(c10d._new_process_group_helper).parameters:
    c10d._new_process_group_helper = _accept_pg_options(c10d._new_process_group_helper)
