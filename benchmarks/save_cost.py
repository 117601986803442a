"""What save_ckpt costs against DeepSpeed's own engine.save_checkpoint of the same engine: a 100M-parameter model at
ZeRO 2 on 2 ranks, one launch, the saves taken alternately (A B C D, D C B A, ...) into fresh folders.

    python benchmarks/save_cost.py                    # 1 to 4 minutes on a 2-core CPU, 3.2 GB of disk at a time
    python benchmarks/save_cost.py --repeats 6 --dir /tmp/save-bench
    python benchmarks/save_cost.py --layers 1 --width 256 --repeats 2 --steps 2    # the smallest setting: seconds

save_ckpt does more than DeepSpeed's save: each rank's random generators, an fsync of every file and folder, the
record with every file's size and its records' CRCs, the renames. The slower rank's time counts. It reports the
median ratio save_ckpt / engine.save_checkpoint over the rounds, with the smallest and the largest, and the same
against DeepSpeed's save followed by an fsync of every file it wrote (the durability save_ckpt pays for).

save_ckpt(background=True) is timed twice in each of its saves: until it returns (the seconds training stops,
against DeepSpeed's unsynced save) and until its thread has committed the checkpoint, nothing else running (against
the synchronous save_ckpt). Then the seconds of one training step while a background write runs, against one
without, in alternating rounds (on 2 cores the writer competes with the step).

Last, what a user pays: the wall time a save adds to a run. Each round runs --steps optimizer steps four ways, in
alternating order: with no save; with a synchronous save_ckpt after the first step; with a background one there, the
run ending once it is committed; and the same with the writer's thread at normal priority (get_strategy's WRITER_NICE
0, not 19). A save's cost is its run's seconds less the no-save run's of the same round; the ratio background /
synchronous says whether the background save ever costs a run more than waiting for the write would.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(args):
    import torch

    sys.path.insert(0, ROOT)
    import get_strategy as module
    from get_strategy import fsync, get_strategy, wait_for_save

    strategy = get_strategy(argparse.Namespace(zero_stage=2, micro_train_batch_size=1, train_batch_size=2))
    strategy.setup_distributed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    engine, _, _ = strategy.prepare((model, strategy.create_optimizer(model, lr=1e-4), None))

    def step():  # one optimizer step; its seconds
        started = time.perf_counter()
        loss = engine(torch.randn(4, args.width)).pow(2).mean()
        strategy.backward(loss, engine, None)
        strategy.optimizer_step(None, engine, None)
        return time.perf_counter() - started

    step()  # the optimizer state exists, as in any checkpoint of a run

    def slowest(seconds):  # the slower rank's
        seconds = torch.tensor(seconds)
        torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX)
        return seconds.item()

    def timed(save, folder):
        shutil.rmtree(folder, ignore_errors=True)
        torch.distributed.barrier()
        started = time.perf_counter()
        save(folder)
        seconds = slowest(time.perf_counter() - started)
        torch.distributed.barrier()
        shutil.rmtree(folder, ignore_errors=True)
        return seconds

    stopped = []  # the seconds each background save_ckpt took to return

    def background_save(folder):  # returns once the state is in CPU memory; the commit is waited for here
        started = time.perf_counter()
        strategy.save_ckpt(engine, folder, background=True)
        returned = time.perf_counter() - started
        wait_for_save(strategy)
        stopped.append(slowest(returned))

    def durable_deepspeed_save(folder):  # DeepSpeed's save, then an fsync of each file this rank wrote
        written, write = [], engine.checkpoint_engine.save
        engine.checkpoint_engine.save = lambda state_dict, path: (write(state_dict, path), written.append(path))
        try:
            engine.save_checkpoint(folder)
        finally:
            del engine.checkpoint_engine.save  # DeepSpeed's method again
        for path in written:
            fsync(path)

    saves = {
        "save_ckpt": lambda folder: strategy.save_ckpt(engine, folder),
        "save_ckpt background, until committed": background_save,
        "engine.save_checkpoint": lambda folder: engine.save_checkpoint(folder),
        "engine.save_checkpoint + fsync": durable_deepspeed_save,
    }
    times = {name: [] for name in saves}
    for repeat in range(args.repeats):
        order = list(saves) if repeat % 2 == 0 else list(reversed(saves))  # A B C, then C B A
        for name in order:
            times[name].append(timed(saves[name], os.path.join(args.dir, name.split()[0])))
    times["save_ckpt background, until it returns"] = stopped
    # A step while a background write runs, against one without, alternately.
    quiet, writing = [], []
    for repeat in range(args.repeats):
        for during in (False, True) if repeat % 2 == 0 else (True, False):
            folder = os.path.join(args.dir, "steps")
            if during:
                strategy.save_ckpt(engine, folder, background=True)
            (writing if during else quiet).append(slowest(step()))
            wait_for_save(strategy)
            torch.distributed.barrier()
            shutil.rmtree(folder, ignore_errors=True)

    # What a save adds to a run of --steps steps, the four ways, alternately.
    def run(save, nice=module.WRITER_NICE):  # --steps steps, a save after the first, ended once it is committed
        folder = os.path.join(args.dir, "run")
        torch.distributed.barrier()
        module.WRITER_NICE, niced = nice, module.WRITER_NICE
        started = time.perf_counter()
        for index in range(args.steps):
            step()
            if index == 0 and save is not None:
                save(folder)
        wait_for_save(strategy)
        seconds = slowest(time.perf_counter() - started)
        module.WRITER_NICE = niced
        torch.distributed.barrier()
        shutil.rmtree(folder, ignore_errors=True)
        return seconds

    runs = {
        "no save": lambda: run(None),
        "synchronous save_ckpt": lambda: run(lambda folder: strategy.save_ckpt(engine, folder)),
        "background save_ckpt": lambda: run(lambda folder: strategy.save_ckpt(engine, folder, background=True)),
        "background, writer at nice 0": lambda: run(lambda f: strategy.save_ckpt(engine, f, background=True), nice=0),
    }
    run_seconds = {name: [] for name in runs}
    for repeat in range(args.repeats):
        for name in list(runs) if repeat % 2 == 0 else list(reversed(runs)):
            run_seconds[name].append(runs[name]())
    if strategy.is_rank_0():
        parameters = sum(p.numel() for p in engine.module.parameters())
        print(f"result: {parameters / 1e6:.1f}M parameters, ZeRO 2, 2 ranks, {args.repeats} rounds", flush=True)
        for name, samples in times.items():
            spread = f"{statistics.median(samples):.2f} s ({min(samples):.2f} to {max(samples):.2f})"
            print(f"result: {name}: median {spread}")
        pairs = [("save_ckpt", "engine.save_checkpoint"), ("save_ckpt", "engine.save_checkpoint + fsync")]
        pairs += [("save_ckpt background, until it returns", "engine.save_checkpoint")]
        pairs += [("save_ckpt background, until committed", "save_ckpt")]
        for ours, baseline in pairs:
            ratios = [a / b for a, b in zip(times[ours], times[baseline])]
            spread = f"{statistics.median(ratios):.3f} ({min(ratios):.3f} to {max(ratios):.3f})"
            print(f"result: {ours} / {baseline}: median {spread}")
        for name, samples in (("a step without a write", quiet), ("a step while a background write runs", writing)):
            print(
                f"result: {name}: median {statistics.median(samples):.2f} s ({min(samples):.2f} to {max(samples):.2f})"
            )
        added = {
            name: [a - b for a, b in zip(samples, run_seconds["no save"])] for name, samples in run_seconds.items()
        }
        for name, samples in run_seconds.items():
            spread = f"{statistics.median(samples):.2f} s ({min(samples):.2f} to {max(samples):.2f})"
            more = f"; adds {statistics.median(added[name]):.2f} s" if name != "no save" else ""
            print(f"result: a run of {args.steps} steps, {name}: median {spread}{more}")
        for name in ("background save_ckpt", "background, writer at nice 0"):
            ratios = [a / b for a, b in zip(added[name], added["synchronous save_ckpt"])]
            spread = f"{statistics.median(ratios):.3f} ({min(ratios):.3f} to {max(ratios):.3f})"
            print(f"result: seconds added to the run, {name} / synchronous save_ckpt: median {spread}")
    strategy.teardown()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=6, help="rounds of the saves, taken in alternating order")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=2896, help="12 x (2896 x 2896 + 2896) = 100.7M parameters")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps in each run that a save is added to")
    parser.add_argument("--dir", default="/tmp/save-bench", help="where the checkpoints go (emptied after each)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    flags = ["--repeats", str(args.repeats), "--layers", str(args.layers), "--width", str(args.width)]
    flags += ["--steps", str(args.steps)]
    cmd = [*torchrun, __file__, "--worker", *flags, "--dir", args.dir]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [line.removeprefix("result: ") for line in done.stdout.splitlines() if line.startswith("result: ")]
    print("\n".join(lines) or done.stdout[-3000:])
    shutil.rmtree(args.dir, ignore_errors=True)
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
