"""What --full_determinism costs train_example.py at ZeRO 2 on two processes: seconds per step and peak memory per rank.

    python benchmarks/determinism_cost.py                 # the example's default model, 30 steps, 3 rounds
    python benchmarks/determinism_cost.py --steps 2 --repeats 1 --tiny --variants normal deterministic   # seconds

Each run is `torchrun --nproc_per_node 2 train_example.py --zero_stage 2 --max_steps STEPS` (half the cores' threads per
rank), with each variant's flags:
- normal: without --full_determinism;
- deterministic: with --full_determinism, as get_strategy.py sets it up now (deterministic kernels; memory that torch
  allocates without initialising is left so);
- nan_filled: with --full_determinism and torch's default fill_uninitialized_memory = True, as release 0.19.0 ran:
  every torch.empty is filled with NaN, DeepSpeed's 2 GB gradient bucket at each micro-step included. This script
  starts those ranks itself (the hidden first argument below) to set that switch back after setup_distributed.
Seconds per step are the example's own "trained N steps in S s" divided by N: its training loop alone, the first
step's warm-up included, start-up and the final evaluation left out. Peak memory is each rank's peak resident set
(VmHWM in /proc), read every 0.1 s while it runs. Runs alternate within each round (A B C, C B A, ...); the figures
are medians over the rounds.
"""

import argparse
import os
import re
import runpy
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAN_FILLED = "--run_example_nan_filled"  # first argument of a rank this script starts for the nan_filled variant
TINY = "--n_layer 1 --n_head 2 --n_embd 32 --block_size 32 --data_bytes 200000 --micro_train_batch_size 2"
TINY += " --train_batch_size 8"


def peak_rss_by_rank(launcher: subprocess.Popen, peaks: dict) -> None:
    """Until launcher ends, note each of its children's (torchrun's workers') peak resident set in MiB, by rank."""
    while launcher.poll() is None:
        with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children") as f:
            workers = f.read().split()
        for pid in workers:
            try:  # a worker may end between the listing and the reads
                with open(f"/proc/{pid}/environ", "rb") as f:
                    rank = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v).get(b"RANK")
                with open(f"/proc/{pid}/status") as f:
                    kib = int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1))
            except (OSError, AttributeError):
                continue
            if rank is not None:
                peaks[int(rank)] = max(peaks.get(int(rank), 0), kib / 1024)
        time.sleep(0.1)


def run(variant: str, steps: int, tiny: bool):
    """(seconds per step, {rank: peak resident MiB}) of one run of the example."""
    flags = f"--zero_stage 2 --max_steps {steps} --logging_steps {steps} --eval_steps {steps} --eval_batches 1"
    flags += f" {TINY}" if tiny else ""
    flags += " --full_determinism" if variant != "normal" else ""
    flags += f" --ckpt_path {tempfile.mkdtemp()}"  # its figures, not into the first command's ckpt/
    script = [os.path.abspath(__file__), NAN_FILLED] if variant == "nan_filled" else ["train_example.py"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *script, *flags.split()]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks = {}
    watcher = threading.Thread(target=peak_rss_by_rank, args=(launcher, peaks))
    watcher.start()
    output = launcher.communicate()[0]
    watcher.join()
    trained = re.search(r"trained (\d+) steps in ([\d.]+) s", output)
    if launcher.returncode != 0 or not trained:
        sys.exit(f"{' '.join(cmd)} failed:\n{output[-4000:]}")
    return float(trained.group(2)) / int(trained.group(1)), peaks


def run_example_nan_filled(example_args: list) -> None:
    """train_example.py with example_args, its uninitialised memory filled with NaN as before this release: the
    switch get_strategy.py now turns off is set back to torch's default once setup_distributed has run."""
    sys.path.insert(0, ROOT)
    import torch

    import get_strategy

    setup_distributed = get_strategy.DeepspeedStrategy.setup_distributed

    def setup_distributed_filling(self, *args, **kwargs):
        setup_distributed(self, *args, **kwargs)
        torch.utils.deterministic.fill_uninitialized_memory = True

    get_strategy.DeepspeedStrategy.setup_distributed = setup_distributed_filling
    sys.argv = [os.path.join(ROOT, "train_example.py"), *example_args]
    runpy.run_path(sys.argv[0], run_name="__main__")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each runs every variant once")
    variants = ["normal", "deterministic", "nan_filled"]
    parser.add_argument(
        "--variants", nargs="+", default=variants, choices=variants, help="runs of each round, in order"
    )
    parser.add_argument("--tiny", action="store_true", help="one block of width 32 over 200 kB (the tests' TINY model)")
    args = parser.parse_args()
    if "normal" not in args.variants:
        parser.error(f"--variants {' '.join(args.variants)} needs normal, the run the others are compared with")
    model = "the tests' TINY model" if args.tiny else "the default model"
    print(f"train_example.py ({model}), ZeRO 2, 2 ranks, {args.steps} steps a run, {args.repeats} rounds")
    seconds = {variant: [] for variant in args.variants}
    peaks = {variant: [] for variant in args.variants}
    for round_ in range(args.repeats):
        for variant in args.variants if round_ % 2 == 0 else args.variants[::-1]:
            per_step, peak = run(variant, args.steps, args.tiny)
            seconds[variant].append(per_step)
            peaks[variant].append(peak)
            memory = " / ".join(f"{peak.get(rank, 0):,.0f}" for rank in (0, 1))
            print(f"round {round_ + 1}, {variant}: {per_step:.3f} s per step, peak MiB {memory}", flush=True)
    print("| variant | seconds per step, median (min to max) | / normal, median | peak resident MiB, rank 0 / rank 1 |")
    print("| --- | --- | --- | --- |")
    normal = max(statistics.median(seconds["normal"]), 1e-9)  # a step may print as 0.00 s at the smallest setting
    for variant in args.variants:
        median = statistics.median(seconds[variant])
        spread = f"{min(seconds[variant]):.3f} to {max(seconds[variant]):.3f}"
        memory = " / ".join(f"{statistics.median(p.get(rank, 0) for p in peaks[variant]):,.0f}" for rank in (0, 1))
        print(f"| {variant} | {median:.3f} ({spread}) | {median / normal:.2f} | {memory} |")
    for variant in args.variants:
        if variant != "normal":
            print(f"{variant} / normal: {statistics.median(seconds[variant]) / normal:.2f}")


if __name__ == "__main__":
    if sys.argv[1:2] == [NAN_FILLED]:
        run_example_nan_filled(sys.argv[2:])
    else:
        main()
