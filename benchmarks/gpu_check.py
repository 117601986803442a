"""get_strategy.py checked end to end on one GPU, for the day one is lent: one process (a world of one, which
setup_distributed describes itself), at most 8 minutes on an H200, every figure into one JSON file and a table. Without
a GPU the same checks run on DeepSpeed's CPU accelerator at the smallest sizes.

    python benchmarks/gpu_check.py --out gpu_check.json
    python benchmarks/gpu_check.py --only collectives zero3_bf16    # a rerun of some checks, by their names

Each check records ok, failed (with its error's last line) or skipped (with the reason), and its figures; a failed
check does not stop the others, and the exit code is 0 only if none failed. The checks, in order:

- environment: torch, CUDA, the device and its capability, the accelerator DeepSpeed picked, the C++ compiler and
  ninja that DeepSpeedCPUAdam's build needs, DeepSpeed's version.
- collectives: strategy.all_reduce and all_gather over the accelerator's backend (NCCL on a GPU, gloo on the CPU)
  against results worked out by hand; nccl_refuses_cpu_tensors, the negative control: a raw
  torch.distributed.all_reduce of a CPU tensor under NCCL must raise (why the strategy moves tensors to the device).
- deterministic_zero3: with full_determinism, a ZeRO 3 bf16 run saved half-way and resumed in a fresh engine ends
  equal to the bit to the uninterrupted run.
- cpu_adam_build: DeepSpeedCPUAdam's build, timed apart: a machine's first use compiles it (about a minute), later
  ones load it from TORCH_EXTENSIONS_DIR (by default ~/.cache/torch_extensions).
- zero0_fp32 ... zero2_bf16_offload (CONFIGURATIONS): the optimizer DeepSpeed built and the one it wraps (on CUDA
  torch's AdamW must be fused); STEPS steps twice uninterrupted, whose difference is the kernels' nondeterminism,
  and once saved with save_ckpt half-way and resumed in a fresh engine, which must differ no more (RESUME_SLACK).
  zero2_bf16_offload runs OFFLOAD_STEPS steps, so that the resume comes late (DeepSpeedCPUAdam's running bias
  corrections drift from pow() after about 10 steps), and also resumes through DeepSpeed's own save and load.
- reshape_zero2_to_*: one ZeRO 2 bf16 checkpoint loaded into each of RESHAPE_TARGETS: the loaded fp32 weights must
  equal the saved ones, and the step after the load must give a finite loss.
- big_model_zero3: a 0.68B-parameter GPT at ZeRO 3 bf16 (3.3M on the CPU): the seconds of save_ckpt, of DeepSpeed's
  own engine.save_checkpoint, of save_ckpt(background=True) until it returns (the seconds training stops; the goal is
  at most 0.1x DeepSpeed's save) and until it is committed, and of load_ckpt in the same shape and into ZeRO 2; the
  peak device memory of save_model and of the load into ZeRO 2.
- example_*: train_example.py's tokens/s, and on a GPU its model FLOPs utilisation (MFU).

Not covered, since it needs 2 GPUs or 2 nodes: NCCL between ranks, each rank bound to its own device by its local
rank, srun and the other launchers, and the checkpoints of a multi-node run on a shared filesystem.
"""

import argparse
import contextlib
import functools
import gc
import importlib.util
import io
import json
import logging
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # get_strategy.py and train_example.py

# DeepSpeed logs at INFO for every engine it builds: a filter set before its logger exists keeps only errors.
logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)
warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402

from get_strategy import __version__, _free_port, get_strategy, wait_for_save  # noqa: E402
from train_example import ByteGPT, byte_loss, load_corpus, model_from_args, parse_args  # noqa: E402

ON_GPU = get_accelerator().device_name() == "cuda"

# Sizes. STEPS: optimizer steps of each run of an engine check (the interrupted run saves at half). MICRO_BATCH:
# sequences per micro-batch, two of them a step. SMALL: the GPT of the engine checks. BIG: the one whose save and
# load are timed. EXAMPLE_RUNS: train_example.py's flags for its tokens/s, beyond --zero_stage 2 (and --bf16 on a GPU).
if ON_GPU:
    STEPS, MICRO_BATCH = 20, 8
    SMALL = dict(n_layer=4, n_head=4, n_embd=256, block_size=128)  # 3.3M parameters
    BIG = dict(n_layer=24, n_head=12, n_embd=1536, block_size=256)  # 12 * 24 * 1536^2 = 0.68B parameters
    # The README's example (0.88M parameters), and one of GPT-2 small's size (85M parameters, 32 x 1024 tokens a
    # step), large enough for its MFU to mean something.
    gpt2_small = ["--n_layer", "12", "--n_head", "12", "--n_embd", "768", "--block_size", "1024"]
    EXAMPLE_RUNS = {"example_defaults": ["--max_steps", "50"], "example_gpt2_small": [*gpt2_small, "--max_steps", "60"]}
else:  # the smallest sizes that still run every path
    STEPS, MICRO_BATCH = 6, 2
    SMALL = dict(n_layer=2, n_head=2, n_embd=32, block_size=16)
    BIG = dict(n_layer=4, n_head=4, n_embd=256, block_size=32)  # 3.3M parameters
    EXAMPLE_RUNS = {"example_defaults": ["--max_steps", "3"]}
OFFLOAD_STEPS = max(STEPS, 20)  # zero2_bf16_offload's steps, on the CPU too: resumed after step 10
SEED = 42  # every engine of one seed starts from the same weights; a resumed engine starts from SEED + 1's
LEARNING_RATE = 1e-3  # AdamW's peak, reached by a linear warm-up over STEPS, so each step has its own rate
RESUME_SLACK = 4  # a resumed run may differ from an uninterrupted one by this many times two uninterrupted runs do
BUDGET_S = 480  # a check that would start after this many seconds is not run (and fails): the GPU's 8 minutes
# NVIDIA's H200 SXM datasheet gives 1,979 TFLOP/s of bf16 with 2:4 sparsity: dense matrices get half of it.
H200_DENSE_BF16_FLOPS = 989e12


# -------------------------------------------------------------------------------------------------------------
# Engines of train_example's GPT, built and trained as a trainer does, on fixed batches


def build(stage: int, size=SMALL, seed=SEED, **flags):
    """A strategy and an engine: get_strategy(args) with the flags, setup_distributed (it reseeds, and after the first
    call reuses the process group), create_optimizer's AdamW, a warm-up schedule and prepare."""
    args = argparse.Namespace(zero_stage=stage, seed=seed, micro_train_batch_size=MICRO_BATCH, **flags)
    args.train_batch_size = 2 * MICRO_BATCH  # two micro-batches a step, so gradients accumulate
    strategy = get_strategy(args)
    strategy.setup_distributed()
    with torch.device(get_accelerator().current_device_name()):  # built on the device: 0.68B at once
        model = ByteGPT(dropout=0.0, **size)
    optimizer = strategy.create_optimizer(model, lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / STEPS))
    engine, _, _ = strategy.prepare((model, optimizer, scheduler))
    return strategy, engine


@functools.cache
def corpus() -> torch.Tensor:
    return torch.frombuffer(bytearray(load_corpus(200_000)), dtype=torch.uint8).long()


def train(strategy, engine, first_step: int, last_step: int, block_size=SMALL["block_size"]) -> float:
    """Optimizer steps first_step + 1 to last_step; step k's micro-batches are the same in every run, so a resumed
    run sees what an uninterrupted one does. Returns the last micro-batch's loss."""
    device, data = get_accelerator().current_device_name(), corpus()
    width = block_size + 1  # a sequence and the byte after it
    batch_bytes = MICRO_BATCH * width
    for step in range(first_step, last_step):
        for micro in range(strategy.accumulated_gradient):
            start = (step * strategy.accumulated_gradient + micro) * batch_bytes % (len(data) - batch_bytes)
            rows = data[start : start + batch_bytes].view(MICRO_BATCH, width).to(device)
            loss = byte_loss(engine, rows[:, :-1], rows[:, 1:])
            strategy.backward(loss, engine, engine.optimizer)
            strategy.optimizer_step(engine.optimizer, engine, engine.lr_scheduler)
    return loss.item()


def fp32_weights(engine) -> dict:
    """Each parameter's fp32 master weight, as DeepSpeed's public getter assembles it (gathered at ZeRO 3). ZeRO 0 has
    no getter: there the module's weight itself, which at bf16 is the master rounded."""
    weights = {}
    for name, p in engine.module.named_parameters():
        master = safe_get_full_fp32_param(p)
        weights[name] = (p if master is None else master).detach().float().cpu()
    return weights


def max_difference(a: dict, b: dict) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in a)


def uninterrupted(stage: int, steps=STEPS, **flags) -> dict:
    strategy, engine = build(stage, **flags)
    train(strategy, engine, 0, steps)
    weights = fp32_weights(engine)
    engine.destroy()  # removes ZeRO 3's hooks and frees the optimizer's buffers
    return weights


def interrupted(stage: int, folder: str, steps=STEPS, deepspeeds_own=False, **flags) -> dict:
    """steps steps, with a save_ckpt half-way and the rest in a fresh engine that resumes it; with deepspeeds_own,
    DeepSpeed's engine.save_checkpoint and engine.load_checkpoint instead."""
    strategy, engine = build(stage, **flags)
    train(strategy, engine, 0, steps // 2)
    if deepspeeds_own:
        engine.save_checkpoint(folder, tag="half_deepspeed", client_state={"step": steps // 2})
    else:
        strategy.save_ckpt(engine, folder, tag="half", client_state={"step": steps // 2})
    engine.destroy()
    strategy, engine = build(stage, seed=SEED + 1, **flags)  # other weights: the checkpoint must replace them all
    if deepspeeds_own:
        _, client_state = engine.load_checkpoint(folder, tag="half_deepspeed")
    else:
        _, client_state = strategy.load_ckpt(engine, folder, tag="half")
    train(strategy, engine, client_state["step"], steps)
    weights = fp32_weights(engine)
    engine.destroy()
    return weights


# -------------------------------------------------------------------------------------------------------------
# The checks. Each fills check.figures and notes what it found wrong with check.expect(); an exception ends it.


class Skipped(Exception):
    """Raised by a check that does not apply here, with the reason."""


class Check:
    def __init__(self, folder: str):
        self.folder = folder  # this check's own folder for checkpoints
        self.figures, self.problems = {}, []

    def expect(self, condition, problem: str) -> None:
        if not condition:
            self.problems.append(problem)


def check_environment(check):
    accelerator = get_accelerator()
    check.figures.update(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda)
    if torch.cuda.is_available():  # what only CUDA has a name for; everything else goes through the accelerator
        check.figures.update(device=torch.cuda.get_device_name(), capability=torch.cuda.get_device_capability())
        check.figures["device_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    check.figures.update(accelerator=accelerator.device_name(), deepspeed=deepspeed.__version__, strategy=__version__)
    # DeepSpeedCPUAdam is compiled on first use: torch's extension builder runs ninja, which runs the C++ compiler.
    check.figures.update({tool: shutil.which(tool) for tool in ("c++", "g++", "ninja")})
    check.figures["py-cpuinfo"] = importlib.util.find_spec("cpuinfo") is not None  # DeepSpeedCPUAdam imports it
    why = "is DS_ACCELERATOR set, or DeepSpeed's CUDA accelerator failing to load?"
    check.expect(accelerator.device_name() == "cuda" or not torch.cuda.is_available(), f"torch sees a GPU: {why}")


def joined():
    """A strategy in the process group: the first setup_distributed() joins it, and every later one reuses it."""
    strategy = get_strategy(argparse.Namespace(zero_stage=0, micro_train_batch_size=1, train_batch_size=1))
    strategy.setup_distributed()
    return strategy


def check_collectives(check):
    strategy = joined()
    world, backend = strategy.world_size, dist.get_backend()
    check.figures.update(backend=backend, world_size=world)
    check.expect(backend == ("nccl" if ON_GPU else "gloo"), f"backend {backend}, not NCCL on a GPU or gloo on a CPU")
    # By hand: every rank gives the same values, so a sum is world times one rank's, a mean and a max are one rank's.
    x = torch.tensor([1.5, -2.0, 3.25])  # on the CPU: the strategy reduces it on the device and brings it back
    on_device = x.to(get_accelerator().device_name())
    bools, ints, rows = torch.tensor([True, False]), torch.tensor([3, 4]), torch.arange(6).view(2, 3)
    cases = {  # what: (the strategy's result, the result by hand)
        "sum of a float tensor": (strategy.all_reduce(x, "sum"), x * world),
        "mean of a bf16 tensor": (strategy.all_reduce(x.bfloat16()), x.bfloat16()),
        "mean of a tensor on the device": (strategy.all_reduce(on_device).cpu(), x),
        "sum of bools, an int64 count": (strategy.all_reduce(bools, "sum"), bools.long() * world),
        "mean of ints, in float64": (strategy.all_reduce(ints), ints.double()),
        "max of a dict's tensor": (strategy.all_reduce({"a": 2, "b": x}, "max")["b"], x),
        "sum of a Python int": (torch.tensor(strategy.all_reduce(3, "sum")), torch.tensor(3 * world)),
        "gathered rows": (strategy.all_gather(rows), rows.repeat(world, 1)),
        "a gathered number": (strategy.all_gather(7), torch.tensor([7] * world)),
    }
    for what, (got, expected) in cases.items():  # equal values and dtypes, and back on the CPU where they came from
        same = got.device == expected.device and got.dtype == expected.dtype and torch.equal(got, expected)
        check.expect(same, f"{what}: got {got}, expected {expected}")
    check.figures["cases"] = len(cases)


def check_nccl_refuses_cpu_tensors(check):
    if not ON_GPU:
        raise Skipped("gloo reduces CPU tensors; the control needs NCCL, which only takes GPU tensors")
    world = joined().world_size
    try:
        dist.all_reduce(torch.ones(3))  # raw torch.distributed, a CPU tensor: NCCL has no CPU path
        check.problems.append("a raw all_reduce of a CPU tensor went through under NCCL: the control proves nothing")
    except Exception as error:
        first_line = str(error).partition("\n")[0]
        check.figures["raised"] = f"{type(error).__name__}: {first_line[:120]}"
    on_device = torch.ones(3, device=get_accelerator().current_device_name())
    dist.all_reduce(on_device)  # the same call with the tensor on the GPU, which the strategy's collectives make
    check.expect(on_device.eq(world).all().item(), f"the same all_reduce on the GPU gave {on_device}, not {world}s")


def check_deterministic_zero3(check):
    try:
        expected = uninterrupted(3, bf16=True, full_determinism=True)
        resumed = interrupted(3, check.folder, bf16=True, full_determinism=True)
    finally:  # setup_distributed switched torch to deterministic kernels for the whole process: switch back
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = True
        torch.backends.cudnn.deterministic = False
    check.figures["resume_difference"] = max_difference(resumed, expected)
    check.expect(all(torch.equal(resumed[name], expected[name]) for name in expected), "the resumed run differs")


def check_cpu_adam_build(check):
    started = time.perf_counter()
    deepspeed.ops.adam.DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))])  # builds or loads the cpu_adam op
    check.figures["build_or_load_s"] = round(time.perf_counter() - started, 1)  # a few seconds once cached


CONFIGURATIONS = {  # name: (stage, flags, the optimizer DeepSpeed 0.19.8 builds, the optimizer it wraps)
    "zero0_fp32": (0, {}, "AdamW", "AdamW"),  # DeepSpeed steps torch's AdamW itself
    "zero0_bf16": (0, {"bf16": True}, "FP16_UnfusedOptimizer", "AdamW"),
    "zero1_bf16_fp32_accum": (1, {"bf16": True, "grad_accum_dtype": "fp32"}, "BF16_Optimizer", "AdamW"),
    "zero2_bf16": (2, {"bf16": True}, "DeepSpeedZeroOptimizer", "AdamW"),
    "zero3_bf16": (3, {"bf16": True}, "DeepSpeedZeroOptimizer_Stage3", "AdamW"),
    "zero2_bf16_offload": (2, {"bf16": True, "adam_offload": True}, "DeepSpeedZeroOptimizer", "DeepSpeedCPUAdam"),
}


def check_configuration(check, name):
    stage, flags, wrapper, inner = CONFIGURATIONS[name]
    strategy, engine = build(stage, **flags)
    built = engine.optimizer
    wrapped = getattr(built, "optimizer", built)  # DeepSpeed's wrappers keep the optimizer they step in .optimizer
    check.figures["optimizer"] = f"{type(built).__name__}({type(wrapped).__name__})"
    check.expect((type(built).__name__, type(wrapped).__name__) == (wrapper, inner), f"expected {wrapper}({inner})")
    if ON_GPU and isinstance(wrapped, torch.optim.AdamW):
        check.figures["fused"] = wrapped.param_groups[0].get("fused")
        check.expect(check.figures["fused"], "torch's AdamW is not fused on CUDA")
    steps = OFFLOAD_STEPS if flags.get("adam_offload") else STEPS
    check.figures["steps"] = steps
    train(strategy, engine, 0, steps)  # this engine is the first uninterrupted run
    first = fp32_weights(engine)
    engine.destroy()
    second, resumed = uninterrupted(stage, steps, **flags), interrupted(stage, check.folder, steps, **flags)
    nondeterminism, difference = max_difference(first, second), max_difference(resumed, first)
    check.figures.update(kernel_nondeterminism=nondeterminism, resume_difference=difference)
    if flags.get("adam_offload"):  # DeepSpeed's own load, the same way: what it gives, for comparison
        deepspeeds = interrupted(stage, check.folder, steps, deepspeeds_own=True, **flags)
        check.figures["deepspeed_load_difference"] = max_difference(deepspeeds, first)
    check.expect(all(torch.isfinite(w).all() for w in resumed.values()), "the resumed weights are not finite")
    if nondeterminism == 0:
        check.expect(difference == 0, "the resumed run differs, though the two uninterrupted runs are identical")
    else:
        check.expect(difference <= RESUME_SLACK * nondeterminism, f"the resumed run differs {RESUME_SLACK}x more")


# What a ZeRO 2 bf16 checkpoint is resumed into: ZeRO 3, the BF16_Optimizer, fp32 without ZeRO, Adam on the CPU.
RESHAPE_TARGETS = ("zero3_bf16", "zero1_bf16_fp32_accum", "zero0_fp32", "zero2_bf16_offload")


@functools.cache
def zero2_checkpoint(folder: str):
    """A ZeRO 2 bf16 checkpoint two steps in, and its fp32 weights as saved: made once, for every reshape check."""
    strategy, engine = build(2, bf16=True)
    train(strategy, engine, 0, 2)
    strategy.save_ckpt(engine, folder, tag="step2", client_state={"step": 2})
    saved = fp32_weights(engine)
    engine.destroy()
    return saved


def check_reshape(check, target):
    folder = os.path.join(os.path.dirname(check.folder), "zero2_checkpoint")
    saved = zero2_checkpoint(folder)
    stage, flags, _, _ = CONFIGURATIONS[target]
    strategy, engine = build(stage, seed=SEED + 1, **flags)
    _, client_state = strategy.load_ckpt(engine, folder, tag="step2")
    check.figures["loaded_vs_saved"] = max_difference(fp32_weights(engine), saved)
    check.expect(check.figures["loaded_vs_saved"] == 0, "the loaded fp32 weights differ from the saved ones")
    check.figures["next_loss"] = train(strategy, engine, client_state["step"], client_state["step"] + 1)
    check.expect(math.isfinite(check.figures["next_loss"]), "the step after the load gave a loss that is not finite")
    engine.destroy()


def measure(check, what: str, function, *args, **kwargs) -> None:
    """Record function(*args, **kwargs)'s seconds (what_s) and on a GPU the device memory allocated at its peak, in all
    (what_peak_gib) and above the start (what_above_gib); the CPU accelerator samples memory only when asked."""
    accelerator = get_accelerator()
    accelerator.synchronize()
    accelerator.reset_peak_memory_stats()
    before, started = accelerator.memory_allocated(), time.perf_counter()
    function(*args, **kwargs)
    accelerator.synchronize()
    check.figures[f"{what}_s"] = round(time.perf_counter() - started, 2)
    if ON_GPU:
        peak = accelerator.max_memory_allocated()
        check.figures[f"{what}_peak_gib"] = round(peak / 2**30, 2)
        check.figures[f"{what}_above_gib"] = round((peak - before) / 2**30, 2)


def check_big_model(check):
    save_big_model(check)
    load_big_model(check, "same_shape", 3)
    load_big_model(check, "into_zero2", 2)


# Each engine in a function of its own, so that its memory can be freed once the function returns.
def save_big_model(check):
    strategy, engine = build(3, BIG, bf16=True)
    check.figures["parameters"] = sum(p.ds_numel for p in engine.module.parameters())  # a ZeRO 3 shard's numel is 0
    train(strategy, engine, 0, 1, BIG["block_size"])  # one step, so there are Adam moments to save
    measure(check, "save_ckpt", strategy.save_ckpt, engine, check.folder, "big", client_state={})
    files = [entry.stat().st_size for entry in os.scandir(os.path.join(check.folder, "big"))]
    check.figures["checkpoint_gb"] = round(sum(files) / 1e9, 2)
    # DeepSpeed's own save, then the background save: the seconds training stops, and until the commit. The first
    # background save makes its pinned buffers, the second reuses them: both are timed.
    measure(check, "deepspeed_save", engine.save_checkpoint, os.path.join(check.folder, "deepspeed"), "big")
    shutil.rmtree(os.path.join(check.folder, "deepspeed"))  # the device's disk holds a few checkpoints at most
    for save in ("first", "second"):
        tag = f"big_{save}"
        measure(check, f"background_{save}_stopped", strategy.save_ckpt, engine, check.folder, tag, background=True)
        measure(check, f"background_{save}_committed", wait_for_save, strategy)
    buffers = engine.checkpoint_engine.buffers  # the snapshot's, in pinned memory on a GPU
    check.figures["snapshot_gb"] = round(sum(b.numel() * b.element_size() for b in buffers) / 1e9, 2)
    if ON_GPU and hasattr(torch.cuda, "host_memory_stats"):  # what the pinned allocator holds, rounded as it rounds
        stats = torch.cuda.host_memory_stats()  # its key for the bytes held: allocated_bytes(.all).current
        pinned = next((v for k, v in stats.items() if k.startswith("allocated_bytes") and k.endswith("current")), 0)
        check.figures["pinned_gb"] = round(pinned / 1e9, 2)
    check.figures["background_stopped_vs_deepspeed"] = round(
        check.figures["background_second_stopped_s"] / check.figures["deepspeed_save_s"], 3
    )
    measure(check, "save_model", strategy.save_model, engine, None, os.path.join(check.folder, "weights"))
    engine.destroy()


def load_big_model(check, shape: str, stage: int):
    gc.collect()  # the previous engine's memory
    get_accelerator().empty_cache()
    strategy, engine = build(stage, BIG, seed=SEED + 1, bf16=True)
    measure(check, f"load_{shape}", strategy.load_ckpt, engine, check.folder, "big")
    loss = train(strategy, engine, 1, 2, BIG["block_size"])
    check.expect(math.isfinite(loss), f"the step after the load ({shape}) gave a loss that is not finite")
    engine.destroy()


def check_example(check, name):
    flags = ["--zero_stage", "2", *(["--bf16"] if ON_GPU else []), *EXAMPLE_RUNS[name]]
    steps = flags[flags.index("--max_steps") + 1]
    flags += ["--eval_steps", steps, "--logging_steps", steps, "--eval_batches", "1"]  # no evaluation while timed
    # A process of its own, started as plain python: without this process's rendezvous variables it makes its world.
    ours = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUBLAS_WORKSPACE_CONFIG")
    env = {key: value for key, value in os.environ.items() if key not in ours}
    cmd = [sys.executable, "train_example.py", *flags, "--ckpt_path", tempfile.mkdtemp()]  # not the repository's ckpt/
    done = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180
    )
    trained = re.search(r"trained (\d+) steps in ([\d.]+) s \(([\d,]+) tokens/s\)", done.stdout)
    if done.returncode != 0 or not trained:
        sys.stderr.write(done.stdout[-3000:])  # the example's own account, on the console
        raise RuntimeError(f"train_example.py exited with {done.returncode}: {done.stdout.strip().splitlines()[-1:]}")
    tokens_per_s = int(trained.group(3).replace(",", ""))  # from before its first step: the warm-up counts
    parameters = sum(p.numel() for p in model_from_args(parse_args(flags)).parameters())
    check.figures.update(flags=" ".join(flags), parameters=parameters, tokens_per_s=tokens_per_s)
    if ON_GPU:  # 6 FLOPs per parameter and token (forward 2, backward 4); attention's own FLOPs are left out
        check.figures["mfu"] = round(6 * parameters * tokens_per_s / H200_DENSE_BF16_FLOPS, 4)


def check_one_visible_device(check):
    """A rank shown a single GPU (srun --gpus-per-task, MPI wrappers setting CUDA_VISIBLE_DEVICES per rank) uses it,
    whatever its local rank: LOCAL_RANK=1 with one device visible, in a process of its own."""
    if not ON_GPU:
        raise Skipped("a device to pick needs a GPU")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0", LOCAL_RANK="1", RANK="0", WORLD_SIZE="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    code = (
        "import argparse, get_strategy as g; s = g.get_strategy(argparse.Namespace(zero_stage=0, train_batch_size=1))"
    )
    code += "; s.setup_distributed(); import torch; e = s.prepare(torch.nn.Linear(2, 2)); x = torch.ones(1, 2)"
    code += "; print('device', torch.cuda.current_device(), e(x.to(e.device)).device); s.teardown()"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    check.figures["output"] = (done.stdout + done.stderr).strip().splitlines()[-1:]
    check.expect(
        done.returncode == 0 and "device 0 cuda:0" in done.stdout, f"exit {done.returncode}: {done.stderr[-300:]}"
    )


CHECKS = {
    "environment": check_environment,
    "one_visible_device": check_one_visible_device,
    "collectives": check_collectives,
    "nccl_refuses_cpu_tensors": check_nccl_refuses_cpu_tensors,
    "deterministic_zero3": check_deterministic_zero3,
    "cpu_adam_build": check_cpu_adam_build,
    **{name: functools.partial(check_configuration, name=name) for name in CONFIGURATIONS},
    **{f"reshape_zero2_to_{name}": functools.partial(check_reshape, target=name) for name in RESHAPE_TARGETS},
    "big_model_zero3": check_big_model,
    **{name: functools.partial(check_example, name=name) for name in EXAMPLE_RUNS},
}


# -------------------------------------------------------------------------------------------------------------
# Running them


def run_check(function, folder: str, late: bool) -> dict:
    """One check's record: status, seconds, figures, and what went wrong."""
    check, started = Check(folder), time.perf_counter()
    try:
        if late:
            raise RuntimeError(f"not run: the {BUDGET_S} s budget was spent")
        with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints as it loads its ops
            function(check)
        status = "failed" if check.problems else "ok"
    except Skipped as reason:
        status, check.figures["reason"] = "skipped", str(reason)
    except (Exception, SystemExit) as error:  # SystemExit: train_example's parser refusing flags
        traceback.print_exc()  # the whole of it on stderr; the record keeps the error and where it was raised
        status, where = "failed", traceback.extract_tb(error.__traceback__)[-1]
        message = " / ".join(str(error).split("\n"))[:300]
        check.problems.append(f"{type(error).__name__}: {message} ({os.path.basename(where.filename)}:{where.lineno})")
    shutil.rmtree(folder, ignore_errors=True)  # the big model's checkpoint is 8 GB
    gc.collect()
    get_accelerator().empty_cache()
    record = {"status": status, "seconds": round(time.perf_counter() - started, 1), **check.figures}
    return dict(record, problems=check.problems) if check.problems else record


def table_row(name: str, record: dict) -> str:
    def shown(value) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    figures = ", ".join(f"{key} {shown(value)}" for key, value in record.items() if key not in ("status", "seconds"))
    return f"| {name} | {record['status']} | {record['seconds']} | {figures} |"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="the JSON file of every check's figures")
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), help="run only these checks (default: all)")
    args = parser.parse_args()
    started = time.perf_counter()
    report = {"script": "benchmarks/gpu_check.py", "on_gpu": ON_GPU, "checks": {}}
    print("| check | status | seconds | figures |\n| --- | --- | --- | --- |", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as work:
        for name, function in CHECKS.items():
            if args.only and name not in args.only:
                continue
            late = time.perf_counter() - started > BUDGET_S
            report["checks"][name] = run_check(function, os.path.join(work, name), late)
            report["seconds"] = round(time.perf_counter() - started, 1)
            with open(args.out, "w") as f:  # after every check, so a run cut short keeps what it measured
                json.dump(report, f, indent=1)
            print(table_row(name, report["checks"][name]), flush=True)
    statuses = [record["status"] for record in report["checks"].values()]
    counts = ", ".join(f"{statuses.count(status)} {status}" for status in ("ok", "skipped", "failed"))
    print(f"checks: {counts}, in {report['seconds']} s; figures in {args.out}")
    if dist.is_initialized():
        joined().teardown()  # as a trainer ends: the process group goes before Python shuts down
    sys.exit(1 if "failed" in statuses else 0)


if __name__ == "__main__":
    main()
