"""Bytes each rank holds for parameters, gradients and optimizer state at ZeRO 0-3, against the ZeRO paper.

    torchrun --nproc_per_node 2 benchmarks/memory_by_stage.py          # CPU: 2 minutes on a 2-core CPU
    torchrun --nproc_per_node 2 benchmarks/memory_by_stage.py --json out.json
    torchrun --nproc_per_node 2 benchmarks/memory_by_stage.py --n_layer 1 --n_embd 48    # the smallest setting

The numbers are read from the tensors the engine and its optimizer hold (each storage counted once, however
many views point into it), not from process memory. They are taken mid-accumulation, after the first
micro-batch's backward of a step: the optimizer has stepped before, so Adam's states exist, and the gradients
are those being accumulated. The model is train_example.py's byte-level GPT at 12 layers x 384 wide.

Theory, per rank, with N ranks and P parameters (Rajbhandari et al., "ZeRO", 2020, section 5):
mixed precision (bf16 here, fp16 in the paper) holds 2P bytes of 16-bit parameters, 2P of 16-bit gradients
and K*P = 12P of optimizer state: a 4-byte fp32 master copy plus Adam's two 4-byte moments. Stage 1 divides
the optimizer state by N, stage 2 also the gradients, stage 3 also the parameters.
In fp32 the parameters are their own master copy: 4P of parameters, 4P of gradients and 8P of Adam moments.
"""

import argparse
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from get_strategy import get_strategy  # noqa: E402
from train_example import ByteGPT  # noqa: E402

CATEGORIES = ["parameters", "gradients", "fp32 master", "Adam moments", "other"]


# What each stage shards over the ranks.
SHARDED_BY_STAGE = {
    0: [],
    1: ["fp32 master", "Adam moments"],
    2: ["gradients", "fp32 master", "Adam moments"],
    3: ["parameters", "gradients", "fp32 master", "Adam moments"],
}


def theory(stage: int, bf16: bool, world: int) -> dict:
    """Bytes per parameter on one rank, by the paper's formula (fp32: no separate master copy)."""
    unsharded = {"parameters": 2 if bf16 else 4, "gradients": 2 if bf16 else 4, "fp32 master": 4 if bf16 else 0}
    unsharded.update({"Adam moments": 8, "other": 0})
    return {c: b / world if c in SHARDED_BY_STAGE[stage] else b for c, b in unsharded.items()}


def category(path: str) -> str:
    """Which kind of state a tensor is, from where it was found (first finder wins)."""
    if path in ("module.param", "module.param.ds_tensor"):
        return "parameters"  # the working copy; under ZeRO 3 the shard (ds_tensor) plus small persistent ones
    if path == "module.param.grad" or "grad" in path.removeprefix("optimizer."):
        return "gradients"  # p.grad, or DeepSpeed's partitioned gradient buffers
    if path == "inner.params" or path.endswith("fp32_partitioned_groups_flat"):
        return "fp32 master"  # what the inner torch optimizer updates: fp32 copies of this rank's shard
    if path == "inner.state":
        return "Adam moments"
    return "other"


def held_tensors(engine, optimizer) -> dict:
    """{storage address: (bytes, path)} for every tensor reachable from the engine's parameters and optimizer."""
    found = {}

    def walk(obj, path, depth=0):
        if depth > 6:
            return
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "meta":  # shape-only tensors hold no memory
                return
            storage = obj.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in found:
                found[storage.data_ptr()] = (storage.nbytes(), path)
            if getattr(obj, "grad", None) is not None:
                walk(obj.grad, path + ".grad", depth + 1)
            if hasattr(obj, "ds_tensor"):  # ZeRO 3: the rank's shard of a parameter
                walk(obj.ds_tensor, path + ".ds_tensor", depth + 1)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item, path, depth + 1)
        elif isinstance(obj, dict):
            for item in obj.values():
                walk(item, path, depth + 1)

    inner = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer inside DeepSpeed's wrapper
    walk(list(engine.module.parameters()), "module.param")
    walk(list(engine.module.buffers()), "module.buffer")
    walk(inner.state, "inner.state")
    walk([group["params"] for group in inner.param_groups], "inner.params")
    for name, value in vars(optimizer).items():
        walk(value, "optimizer." + name)
    return found


def measure(stage: int, bf16: bool, args) -> dict:
    flags = argparse.Namespace(zero_stage=stage, bf16=bf16, micro_train_batch_size=1, train_batch_size=2 * args.world)
    strategy = get_strategy(flags)
    strategy.setup_distributed()
    model = ByteGPT(args.n_layer, 6, args.n_embd, 64, 0.0)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = strategy.create_optimizer(model, lr=1e-4)
    engine, optimizer, _ = strategy.prepare((model, optimizer, None))
    x = torch.randint(0, 256, (1, 64))
    for micro_step in range(2 * strategy.accumulated_gradient + 1):  # two full steps, then one micro-batch more
        loss = engine(x).float().logsumexp(-1).mean()
        strategy.backward(loss, engine, optimizer)
        if micro_step < 2 * strategy.accumulated_gradient:
            strategy.optimizer_step(optimizer, engine, None)

    by_category, by_path = defaultdict(int), defaultdict(int)
    for nbytes, path in held_tensors(engine, optimizer).values():
        by_category[category(path)] += nbytes
        by_path[path] += nbytes
    strategy.optimizer_step(optimizer, engine, None)  # finish the step, so the engine is left consistent
    return {
        "stage": stage,
        "dtype": "bf16" if bf16 else "fp32",
        "params": n_params,
        "optimizer": type(optimizer).__name__,
        "bytes": {c: by_category[c] for c in CATEGORIES},
        "by_path": dict(by_path),
        "theory_per_param": theory(stage, bf16, strategy.world_size),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n_layer", type=int, default=12, help="transformer blocks of the measured model")
    parser.add_argument("--n_embd", type=int, default=384, help="width of the measured model")
    parser.add_argument("--json", help="also write every rank's measurements to this file")
    args = parser.parse_args()
    args.world = int(os.environ.get("WORLD_SIZE", "1"))

    rows = [measure(stage, bf16, args) for bf16 in (False, True) for stage in range(4)]
    strategy = get_strategy(argparse.Namespace(zero_stage=0))
    every_rank = [None] * args.world
    torch.distributed.all_gather_object(every_rank, rows)
    if strategy.is_rank_0():
        report(every_rank, args.world)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(every_rank, f, indent=1)
    strategy.teardown()


def report(every_rank, world):
    n_params = every_rank[0][0]["params"]
    print(f"\n{n_params / 1e6:.2f}M parameters, {world} ranks; bytes per parameter on the rank holding most")
    print("(measured / ZeRO-paper theory); 'partitioned' compares only the states the stage shards\n")
    header = (
        f"{'dtype':5} {'stage':5} " + " ".join(f"{c:>15}" for c in CATEGORIES) + f" {'total':>15} {'partitioned':>11}"
    )
    print(header)
    for i, row in enumerate(every_rank[0]):
        worst = {c: max(rank[i]["bytes"][c] for rank in every_rank) / n_params for c in CATEGORIES}
        expected = row["theory_per_param"]
        cells = [f"{worst[c]:6.3f} / {expected[c]:5.2f}" for c in CATEGORIES]
        total = f"{sum(worst.values()):6.3f} / {sum(expected.values()):5.2f}"
        sharded = [c for c in SHARDED_BY_STAGE[row["stage"]] if expected[c]]  # fp32 has no master copy in theory
        ratio = sum(worst[c] for c in sharded) / sum(expected[c] for c in sharded) if sharded else float("nan")
        print(
            f"{row['dtype']:5} {row['stage']:5} " + " ".join(f"{c:>15}" for c in cells) + f" {total:>15} {ratio:11.3f}"
        )
    print("\nWhere each kind of byte was found (rank 0, MB):")
    for row in every_rank[0]:
        paths = ", ".join(f"{p} {b / 2**20:.1f}" for p, b in sorted(row["by_path"].items(), key=lambda kv: -kv[1]))
        print(f"  {row['dtype']} stage {row['stage']} ({row['optimizer']}): {paths}")


if __name__ == "__main__":
    main()
