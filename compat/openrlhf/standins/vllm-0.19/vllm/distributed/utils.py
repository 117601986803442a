"""vLLM's StatelessProcessGroup: a store that ranks outside torch's default process group meet through. OpenRLHF
0.10.1 (utils/distributed_util.py, stateless_init_process_group) makes one between the actor's rank 0 (rank 0, which
serves it) and each generation engine, to send the actor's weights. Here it is torch's own TCPStore."""

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass
class StatelessProcessGroup:
    rank: int
    world_size: int
    store: dist.Store

    @staticmethod
    def create(host, port, rank, world_size, store_timeout=300):
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=store_timeout))
        return StatelessProcessGroup(rank=rank, world_size=world_size, store=store)
