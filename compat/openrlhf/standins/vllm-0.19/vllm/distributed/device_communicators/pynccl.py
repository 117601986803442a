"""vLLM's PyNcclCommunicator needs NCCL and a GPU: this one broadcasts over gloo, on the CPU, between the ranks of a
StatelessProcessGroup (../utils.py). OpenRLHF 0.10.1 calls broadcast(tensor, src=0, stream=...) on the actor's rank 0
and, through the engine's WorkerWrap (the stand-in's update_weight here), on the engine."""

import torch
import torch.distributed as dist


class PyNcclCommunicator:
    def __init__(self, group, device=None):
        self.rank, self.world_size = group.rank, group.world_size
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("weights", group.store), group.rank, group.world_size)

    def broadcast(self, tensor, src, stream=None):
        # Sent as its bytes (gloo has no bfloat16 or int16), so that any dtype arrives exactly as it was. A view of the
        # tensor's own memory: the bytes received land in it. Both sides' tensors are contiguous (weights, and
        # torch.empty on the engine).
        bits = tensor.reshape(-1).view(torch.uint8)
        assert bits.data_ptr() == tensor.data_ptr(), "the weight to send is not contiguous"
        options = dist.BroadcastOptions()
        options.rootRank = src
        self.group.broadcast([bits], options).wait()
