"""The README's first command's training, as a newcomer runs it (`deepspeed train_example.py --zero_stage 2`, one
process on a machine without a GPU), with the flags of each variant added: its training time and final loss.

    python benchmarks/first_command.py                                   # the defaults
    python benchmarks/first_command.py --variants "" "--micro_train_batch_size 32"
    python benchmarks/first_command.py --variants "--max_steps 2 --eval_steps 1 --eval_batches 1"   # seconds

For each variant, one run: the training seconds and tokens/s the example prints (from its first step to its last,
so start-up and the final evaluation are left out, the evaluations in between are in), the final held-out loss
against the unigram baseline, and the whole command's wall-clock seconds.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(variant: str) -> str:
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [sys.executable, deepspeed, "train_example.py", "--zero_stage", "2", *variant.split()]
    cmd += ["--ckpt_path", tempfile.mkdtemp()]  # its figures, not into the README's run's ckpt/
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - started
    final = re.search(r"final held-out loss ([\d.]+) nats/byte; unigram baseline ([\d.]+)", done.stdout)
    trained = re.search(r"trained (\d+) steps in ([\d.]+) s \(([\d,]+) tokens/s\)", done.stdout)
    if done.returncode != 0 or not (final and trained):
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]}")
    steps, seconds, tokens_per_s = int(trained.group(1)), float(trained.group(2)), trained.group(3)
    return (
        f"| `{variant or '(defaults)'}` | {steps} | {tokens_per_s} | {seconds:.0f} | {final.group(1)} "
        f"| {final.group(2)} | {wall:.0f} |"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=[""], help="flags added to the command, one string each")
    args = parser.parse_args()
    print("| flags added | steps | tokens/s | training seconds | final held-out loss | unigram | wall seconds |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for variant in args.variants:
        print(run(variant), flush=True)


if __name__ == "__main__":
    main()
