"""How many of a checkpoint's files each rank opens to load it: load_ckpt against DeepSpeed's own
engine.load_checkpoint, in the saving run's shape at ZeRO 2 and ZeRO 3, and load_ckpt in other shapes. Every
openat of every rank's process (Python's, torch's and DeepSpeed's alike) is traced with strace.

    python benchmarks/load_opens.py                       # 8 ranks, about two minutes on a 2-core CPU
    python benchmarks/load_opens.py --ranks 4 --json /tmp/opens.json
    python benchmarks/load_opens.py --strategy_dir DIR    # another release's get_strategy.py, in DIR

Three launches of a small model: --ranks ranks save a ZeRO 2 and a ZeRO 3 checkpoint; --ranks ranks, traced, load
each in its own shape (load_ckpt, then DeepSpeed's own load) and in the other stage; half as many ranks, traced,
load each at its own stage. For each load it prints the checkpoint's files F and, over the ranks, the most and the
total of its files one rank opened; and for a load in the saving run's shape what that gives at 1,024 ranks, where
a rank's count stays what it is here, unless it opened every file (F grows as 3 files a rank at ZeRO 3, 2 below).
"""

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG = "global_step1"


def worker(args):
    import torch

    sys.path.insert(0, args.strategy_dir or ROOT)
    from get_strategy import get_strategy

    world_size = int(os.environ["WORLD_SIZE"])
    engines = {}
    for stage in (2, 3):
        flags = argparse.Namespace(zero_stage=stage, micro_train_batch_size=1, train_batch_size=world_size)
        strategy = get_strategy(flags)
        strategy.setup_distributed()
        torch.manual_seed(0)
        # Two weights of 160,000 elements (ZeRO 3 shards what passes its persistence threshold, 100,000) and the
        # small ones every rank keeps whole at ZeRO 3.
        model = torch.nn.Sequential(torch.nn.Linear(400, 400), torch.nn.LayerNorm(400), torch.nn.Linear(400, 400))
        engine = strategy.prepare((model, strategy.create_optimizer(model, lr=1e-3), None))[0]
        engines[stage] = (strategy, engine)
    marks = os.path.join(args.dir, "marks")
    if args.phase == "save":
        for stage, (strategy, engine) in engines.items():
            loss = engine(torch.randn(1, 400)).pow(2).mean()
            strategy.backward(loss, engine, None)
            strategy.optimizer_step(None, engine, None)
            strategy.save_ckpt(engine, os.path.join(args.dir, f"zero{stage}"), tag=TAG)
        os.makedirs(marks, exist_ok=True)
    else:
        loads = [(f"zero{stage}", stage, "load_ckpt") for stage in (2, 3)]
        if args.phase == "load_all":
            loads += [(f"zero{stage}", stage, "deepspeed") for stage in (2, 3)]
            loads += [("zero2", 3, "load_ckpt"), ("zero3", 2, "load_ckpt")]
        rank = torch.distributed.get_rank()
        for saved, stage, how in loads:
            strategy, engine = engines[stage]
            torch.distributed.barrier()
            # A mark in the trace: every openat after it, up to the next mark, belongs to this load.
            open(os.path.join(marks, f"{args.phase}-{saved}-zero{stage}-{how}-rank{rank}"), "w").close()
            if how == "deepspeed":
                engine.load_checkpoint(os.path.join(args.dir, saved), tag=TAG)
            else:
                strategy.load_ckpt(engine, os.path.join(args.dir, saved))
            torch.distributed.barrier()
        open(os.path.join(marks, f"{args.phase}-end-rank{rank}"), "w").close()
    engines[2][0].teardown()


def launch(args, phase, ranks, trace):
    """One torchrun launch of this file's worker, each rank under strace when trace is a folder."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
    run = [sys.executable, __file__, "--worker", "--phase", phase, "--dir", args.dir]
    run += ["--strategy_dir", args.strategy_dir] if args.strategy_dir else []
    if trace:  # each rank's whole process (all its threads) into trace/rank<N>
        strace = 'exec strace -f --seccomp-bpf -qq -e trace=openat -o "$0/$1.rank$RANK" "${@:2}"'
        cmd += ["--no-python", "bash", "-c", strace, trace, phase, *run]
    else:
        cmd += run[1:]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        sys.exit(f"{phase} failed:\n{done.stdout[-5000:]}")


def opened(trace_file):
    """{load: the set of paths its rank opened}, cut at the marks the worker opened."""
    loads, current = {}, None
    with open(trace_file) as f:
        for line in f:
            found = re.search(r'openat\([^,]+, "([^"]+)"', line)
            if not found:
                continue
            path = found.group(1)
            if "/marks/" in path:
                current = re.sub(r"-rank\d+$", "", os.path.basename(path))
                loads[current] = set()
            elif current is not None:
                loads[current].add(path)
    return loads


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--strategy_dir", help="the folder of the get_strategy.py to measure (default: this one's)")
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    args.dir = tempfile.mkdtemp(prefix="load-opens-")
    trace = os.path.join(args.dir, "trace")
    os.makedirs(trace)
    try:
        launch(args, "save", args.ranks, None)
        launch(args, "load_all", args.ranks, trace)
        launch(args, "load_fewer", args.ranks // 2, trace)
        files = {saved: len(os.listdir(os.path.join(args.dir, saved, TAG))) for saved in ("zero2", "zero3")}
        per_load = {}  # load -> [files of the checkpoint one rank opened, per rank]
        for name in sorted(os.listdir(trace)):
            for load, paths in opened(os.path.join(trace, name)).items():
                if load.endswith("-end"):
                    continue
                saved = load.split("-")[1]
                folder = os.path.join(args.dir, saved, TAG) + "/"
                per_load.setdefault(load, []).append(len({p for p in paths if p.startswith(folder)}))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    print("| load | ranks | the checkpoint's files F | most one rank opened | all ranks together | at 1,024 ranks |")
    print("| --- | --- | --- | --- | --- | --- |")
    figures = {}
    for load, counts in per_load.items():
        phase, saved, stage, how = load.split("-")
        ranks = len(counts)
        f = files[saved]
        # At 1,024 ranks each rank's own count stays what it is here; a load that opened every file opens them all.
        per_rank = 3 if saved == "zero3" else 2  # ZeRO 3: optimizer, model states, generators; below: no model states
        if saved[-1] != stage[-1] or ranks != args.ranks:
            at_scale = "-"  # another shape: see benchmarks/README.md
        elif max(counts) == f:  # every file, on every rank
            at_scale = f"{per_rank * 1024 + 1:,} each, {(per_rank * 1024 + 1) * 1024:,} in all"
        else:
            at_scale = f"{max(counts)} each, {max(counts) * 1024:,} in all"
        print(f"| {how} {saved} -> {stage} | {ranks} | {f} | {max(counts)} | {sum(counts)} | {at_scale} |")
        figures[f"{how} {saved} -> {stage} on {ranks}"] = dict(files=f, most=max(counts), total=sum(counts))
        limit = math.ceil(f / ranks) + 6
        figures[f"{how} {saved} -> {stage} on {ranks}"]["limit"] = limit
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=1)


if __name__ == "__main__":
    main()
