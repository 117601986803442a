"""What get_strategy.py costs: the same training loop driven through DeepspeedStrategy and through raw
deepspeed.initialize and engine calls, on two CPU processes.

    python benchmarks/overhead.py            # 5 to 10 minutes on a 2-core CPU
    python benchmarks/overhead.py --repeats 20 --startup_repeats 8
    python benchmarks/overhead.py --repeats 1 --steps 1 --startup_repeats 0    # the smallest setting: seconds

Per-step time: one two-rank launch builds both engines (same model, same ds_config, same data) and times them
in alternating blocks, A B B A A B ..., so drift in machine speed falls on both. Each block gives a median
step time; each pair of blocks a ratio strategy / raw. Start-up (from the script's first line to the end of the
first optimizer step, the slower rank): separate launches, alternating strategy and raw.
"""

import time

STARTED = time.perf_counter()  # before any import, for the start-up measurement

import argparse  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO, TRAIN, BLOCK = 4, 16, 128  # two ranks: 2 accumulation steps of 4 sequences of 128 bytes per rank
# The ds_config the raw path passes by hand; the benchmark checks it equals what the strategy builds.
RAW_CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "train_batch_size": TRAIN,
    "gradient_clipping": 1.0,
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "none", "pin_memory": True},
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "bf16": {"enabled": False},
    "steps_per_print": 1 << 30,
    "wall_clock_breakdown": False,
}


def build(variant):
    """(step function, process group ready) for 'strategy' or 'raw'; imports happen here, inside the timing."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, ROOT)
    from train_example import ByteGPT

    def make_model():
        torch.manual_seed(0)
        return ByteGPT(n_layer=4, n_head=4, n_embd=256, block_size=BLOCK, dropout=0.0)  # 3.3M parameters

    data = torch.randint(0, 256, (MICRO, BLOCK + 1), generator=torch.Generator().manual_seed(1))
    x, y = data[:, :-1], data[:, 1:]

    def loss_of(engine):
        return F.cross_entropy(engine(x).flatten(0, 1), y.flatten())

    if variant == "strategy":
        from get_strategy import get_strategy

        strategy = get_strategy(argparse.Namespace(zero_stage=2, micro_train_batch_size=MICRO, train_batch_size=TRAIN))
        strategy.setup_distributed()
        assert strategy.get_ds_train_config() == RAW_CONFIG, "the two paths must run the same ds_config"
        model = make_model()
        optimizer = strategy.create_optimizer(model, lr=1e-3, weight_decay=0.1)
        engine, optimizer, _ = strategy.prepare((model, optimizer, None))

        def step():
            for _ in range(strategy.accumulated_gradient):
                strategy.backward(loss_of(engine), engine, optimizer)
                strategy.optimizer_step(optimizer, engine, None)

        return step

    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        deepspeed.init_distributed()
    torch.manual_seed(42)
    model = make_model()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3
    )
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=RAW_CONFIG)
    accumulation = TRAIN // (MICRO * dist.get_world_size())

    def step():
        for _ in range(accumulation):
            engine.backward(loss_of(engine))
            engine.step()

    return step


def child_steps(args):
    import torch.distributed as dist

    steps = {variant: build(variant) for variant in ("strategy", "raw")}
    for step in steps.values():  # warm-up: first steps allocate optimizer state and buffers
        for _ in range(3):
            step()
    medians = {"strategy": [], "raw": []}
    order = ["strategy", "raw"]
    for repeat in range(args.repeats):
        for variant in order if repeat % 2 == 0 else order[::-1]:  # A B, then B A, ...
            dist.barrier()
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                steps[variant]()
                times.append(time.perf_counter() - start)
            medians[variant].append(statistics.median(times))
    if dist.get_rank() == 0:
        print("STEP_MEDIANS", medians["strategy"], medians["raw"], flush=True)
    end_cleanly()


def child_startup(variant):
    import torch
    import torch.distributed as dist

    build(variant)()
    elapsed = torch.tensor(time.perf_counter() - STARTED)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print("STARTUP", elapsed.item(), flush=True)
    end_cleanly()


def end_cleanly():
    """After the timing, both paths end the same way (see DeepspeedStrategy.teardown)."""
    from get_strategy import DeepspeedStrategy

    DeepspeedStrategy(zero_stage=0).teardown()


def launch(*child_args):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        os.path.abspath(__file__),
        *child_args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]}")
    return done.stdout


def spread(values):
    return f"median {statistics.median(values):.4f}, min {min(values):.4f}, max {max(values):.4f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10, help="pairs of timed blocks")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per timed block")
    parser.add_argument("--startup_repeats", type=int, default=5, help="pairs of start-up launches")
    parser.add_argument("--child", choices=["steps", "strategy", "raw"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "steps":
        return child_steps(args)
    if args.child:
        return child_startup(args.child)

    output = launch("--child", "steps", "--repeats", str(args.repeats), "--steps", str(args.steps))
    strategy_medians, raw_medians = (
        [float(v) for v in re.findall(r"[\d.e-]+", part)]
        for part in re.search(r"STEP_MEDIANS (\[.*?\]) (\[.*?\])", output).groups()
    )
    ratios = [a / b for a, b in zip(strategy_medians, raw_medians, strict=True)]
    print(f"per-step time, 2 ranks, ZeRO 2, 3.3M parameters, {args.repeats} block pairs of {args.steps} steps")
    print(f"  strategy s/step: {spread(strategy_medians)}")
    print(f"  raw      s/step: {spread(raw_medians)}")
    print(f"  ratio strategy / raw: {spread(ratios)}")

    if args.startup_repeats == 0:
        return
    launch("--child", "raw")  # untimed: lets the first launch's one-off costs (op builds, file caches) pass
    startup = {"strategy": [], "raw": []}
    for repeat in range(args.startup_repeats):
        for variant in ("strategy", "raw") if repeat % 2 == 0 else ("raw", "strategy"):
            startup[variant].append(float(re.search(r"STARTUP ([\d.]+)", launch("--child", variant)).group(1)))
    ratios = [a / b for a, b in zip(startup["strategy"], startup["raw"], strict=True)]
    print(f"start-up, first line to first optimizer step, {args.startup_repeats} launch pairs")
    print(f"  strategy s: {spread(startup['strategy'])}")
    print(f"  raw      s: {spread(startup['raw'])}")
    print(f"  ratio strategy / raw: {spread(ratios)}")


if __name__ == "__main__":
    main()
