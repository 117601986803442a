"""What a load costs: one checkpoint of a 100M-parameter model, saved by 2 ranks at ZeRO 2, loaded by 2 ranks with
DeepSpeed's own engine.load_checkpoint (the reference, same shape only) and with load_ckpt at ZeRO 2 (the same
shape) and at ZeRO 3 (another shape), in one run.

    python benchmarks/reshape_load.py                 # about a minute on a 2-core CPU, 1.6 GB of disk
    python benchmarks/reshape_load.py --repeats 3 --dir /tmp/reshape-bench
    python benchmarks/reshape_load.py --layers 1 --width 64 --repeats 1    # the smallest setting: seconds

It reports, per rank (the slower rank's time counts):
- the load time of each, the median of --repeats loads taken in turn (the page cache is warm for all: the first
  load reads the files in, and every later one finds them there);
- the peak anonymous memory (RssAnon: memory the process owns, not the page cache that memory-mapped files use)
  during the ZeRO 3 load, less what the rank still holds after it (the first load creates the optimizer state
  that the first step would otherwise create), against the size of the largest parameter;
- what choosing the checkpoint and checking the files' sizes and CRCs (each rank its share) adds to a load_ckpt:
  its time against the same load's time less the check; and the time of the read-back through DeepSpeed's public
  getters.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


class PeakMemory:
    """Samples RssAnon every millisecond between start() and stop(); peak is the highest above the start."""

    def start(self):
        self.base, self.peak, self.running = rss_anon(), 0, True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, rss_anon() - self.base)
            time.sleep(0.001)

    def stop(self):
        """(peak above the start, held above the start now)."""
        self.running = False
        self.thread.join()
        return self.peak, rss_anon() - self.base


def worker(args):
    import torch

    sys.path.insert(0, ROOT)
    from get_strategy import Checkpoints, ReshapingReader, get_strategy

    def build(stage):
        strategy = get_strategy(argparse.Namespace(zero_stage=stage, micro_train_batch_size=1, train_batch_size=2))
        strategy.setup_distributed()
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
        return strategy, strategy.prepare((model, strategy.create_optimizer(model, lr=1e-4), None))[0]

    strategy, saving = build(2)
    loss = saving(torch.randn(4, args.width)).pow(2).mean()
    strategy.backward(loss, saving, None)
    strategy.optimizer_step(None, saving, None)
    started = time.perf_counter()
    strategy.save_ckpt(saving, args.dir)
    save_seconds = time.perf_counter() - started
    zero3_strategy, zero3 = build(3)
    engines = {"DeepSpeed's own load, same shape": (None, saving)}
    engines.update({"load_ckpt, same shape": (strategy, saving), "load_ckpt, ZeRO 3": (zero3_strategy, zero3)})
    times = {name: [] for name in engines}
    checks, verifies = [], []
    memory = PeakMemory()

    def timed(method, seconds):  # method, adding its time to seconds[-1]
        def run(self, *a, **k):
            started = time.perf_counter()
            try:
                return method(self, *a, **k)
            finally:
                seconds[-1] += time.perf_counter() - started

        return run

    # The choice and the check (sizes and CRCs, each rank its share of the files), and the read-back through
    # DeepSpeed's public getters.
    Checkpoints._choose_checkpoint = timed(Checkpoints._choose_checkpoint, checks)
    ReshapingReader.verify = timed(ReshapingReader.verify, verifies)
    transient, kept = 0, []
    for repeat in range(args.repeats):
        for name, (s, engine) in engines.items():
            checks.append(0.0)
            verifies.append(0.0)
            torch.distributed.barrier()
            if name.endswith("ZeRO 3"):
                memory.start()
            started = time.perf_counter()
            if s is None:
                engine.load_checkpoint(args.dir, tag="global_step1")
            else:
                s.load_ckpt(engine, args.dir)
            times[name].append((time.perf_counter() - started, checks[-1], verifies[-1]))
            if name.endswith("ZeRO 3"):
                peak, held = memory.stop()
                transient, kept = max(transient, peak - held), kept + [held]
    rank = strategy.get_rank()
    largest = max(p.numel() for p in saving.module.parameters()) * 4
    lines = [f"rank {rank}: save {save_seconds:.1f} s"]
    for name, samples in times.items():
        load = statistics.median(t for t, _, _ in samples)
        check = statistics.median(c for _, c, _ in samples)
        verify = statistics.median(v for _, _, v in samples)
        ratio = load / (load - check)
        lines.append(f"rank {rank}: {name}: load {load:.2f} s, of which the check {check:.2f} s")
        lines[-1] += f" (a load with the check takes {ratio:.2f}x one without) and the read-back {verify:.3f} s"
    own, same, other = (statistics.median(t for t, _, _ in times[n]) for n in engines)
    lines.append(f"rank {rank}: load_ckpt same shape / DeepSpeed's own load = {same / own:.2f}")
    lines.append(f"rank {rank}: load_ckpt ZeRO 3 / DeepSpeed's own load = {other / own:.2f}")
    kept_mib = [round(k / 2**20) for k in kept]
    lines.append(f"rank {rank}: ZeRO 3 load: RssAnon kept after each load {kept_mib} MiB; ")
    lines[-1] += f"peak above that {transient / 2**20:.0f} MiB; largest parameter {largest / 2**20:.0f} MiB "
    lines[-1] += f"({transient / largest:.2f}x)"
    outputs = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(outputs, "\n".join(lines))
    if rank == 0:
        print("\n".join(outputs), flush=True)
    strategy.teardown()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    # 12 x (2896 x 2896 + 2896) = 100.7M parameters; the largest weight is 8.4M (33.5 MB).
    parser.add_argument("--width", type=int, default=2896)
    parser.add_argument("--dir", default="/tmp/reshape-bench", help="checkpoint folder, emptied first")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    shutil.rmtree(args.dir, ignore_errors=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    flags = ["--repeats", str(args.repeats), "--layers", str(args.layers), "--width", str(args.width)]
    cmd = [*torchrun, __file__, "--worker", *flags, "--dir", args.dir]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print("\n".join(line for line in done.stdout.splitlines() if line.startswith("rank ")) or done.stdout[-3000:])
    shutil.rmtree(args.dir, ignore_errors=True)
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
