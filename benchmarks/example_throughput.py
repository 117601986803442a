"""Training throughput of train_example.py (its default model) at each ZeRO stage, in fp32 and bf16.

    python benchmarks/example_throughput.py                # two processes per run; bf16 is slow on a CPU without bf16 instructions
    python benchmarks/example_throughput.py --nproc 1 --steps 200
    python benchmarks/example_throughput.py --stages 0 --dtypes fp32 --steps 2    # the smallest setting: seconds

Each run is `torchrun --nproc_per_node N train_example.py --zero_stage S [--bf16] --max_steps STEPS`; the figure
is the example's own tokens/s at its last step: every token trained on, over all ranks, divided by the time
since the first step began (so start-up is excluded and the first step's warm-up is included).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tokens_per_second(nproc: int, stage: int, bf16: bool, steps: int) -> float:
    flags = f"--zero_stage {stage} --max_steps {steps} --logging_steps {steps} --eval_steps {steps} --eval_batches 1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "train_example.py"]
    cmd += flags.split() + (["--bf16"] if bf16 else [])
    cmd += ["--ckpt_path", tempfile.mkdtemp()]  # its figures, not into the first command's ckpt/
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, os.cpu_count() // nproc))}
    done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found = re.findall(r"\| ([\d,]+) tokens/s", done.stdout)
    if done.returncode != 0 or not found:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]}")
    return float(found[-1].replace(",", ""))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes per run")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], help="ZeRO stages to run")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    args = parser.parse_args()
    print(f"train_example.py defaults, {args.nproc} processes, {args.steps} steps; tokens/s over all ranks")
    print(f"{'stage':>5}" + "".join(f" {dtype:>10}" for dtype in args.dtypes))
    for stage in args.stages:
        figures = [tokens_per_second(args.nproc, stage, dtype == "bf16", args.steps) for dtype in args.dtypes]
        print(f"{stage:>5}" + "".join(f" {figure:>10,.0f}" for figure in figures), flush=True)


if __name__ == "__main__":
    main()
