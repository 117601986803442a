"""Train a small byte-level GPT on the source of Python's standard library, through get_strategy.py.

The text is already on every machine with Python, so nothing is downloaded. With the defaults the run takes
about two minutes on a 2-core CPU and ends well below the unigram baseline (the loss of predicting each byte
from byte frequencies alone).

One machine:
    deepspeed train_example.py --zero_stage 2                # one process per GPU; one process on a CPU-only machine
    deepspeed --num_gpus 2 train_example.py --zero_stage 3   # two processes, also on CPU (gloo)
    torchrun --nproc_per_node 2 train_example.py --zero_stage 2
    python train_example.py --zero_stage 2                   # one process, no launcher

Several machines (here two, each with 8 GPUs), either with the deepspeed launcher and a hostfile of lines
"HOSTNAME slots=8" (it reaches the hosts over passwordless ssh):
    deepspeed --hostfile hostfile --master_addr HOST0 train_example.py --zero_stage 3
or with torchrun started on every machine:
    torchrun --nnodes 2 --node_rank 0 --master_addr HOST0 --master_port 29500 --nproc_per_node 8 train_example.py ...
    torchrun --nnodes 2 --node_rank 1 --master_addr HOST0 --master_port 29500 --nproc_per_node 8 train_example.py ...

Checkpoints and resuming (rerun the same command with --load_checkpoint after an interruption, also with another
number of ranks or --zero_stage; sent SIGTERM or SIGUSR1, the run saves a checkpoint and exits with 128 + it):
    deepspeed train_example.py --zero_stage 2 --ckpt_path ckpt --save_steps 50 --load_checkpoint --save_path out
    torchrun --max_restarts 3 --nproc_per_node 2 train_example.py --zero_stage 2 --save_steps 50 --load_checkpoint
"""

import argparse
import contextlib
import glob
import importlib.util
import itertools
import json
import logging
import io
import math
import os
import signal
import sys
import sysconfig
import tempfile
import time
import warnings

# Only the standard library above this line: torch and DeepSpeed take seconds to import, so the flags are parsed
# and checked first (see the bottom of the file), and --help or a bad value answers at once.


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )

    # The strategy's flags: get_strategy() reads them, with the same names.
    group = parser.add_argument_group("strategy")
    group.add_argument(
        "--zero_stage",
        type=int,
        default=2,
        choices=[0, 1, 2, 3],
        help="ZeRO stage: 0 data parallel, 1 shards optimizer states, 2 and gradients, 3 and parameters",
    )
    group.add_argument("--micro_train_batch_size", type=int, default=8, help="sequences per rank per forward/backward")
    group.add_argument(
        "--train_batch_size",
        type=int,
        default=None,
        help="sequences per optimizer step over all ranks, a multiple of micro_train_batch_size * ranks "
        "(default: 32, rounded up to such a multiple)",
    )
    group.add_argument(
        "--max_norm", type=float, default=1.0, help="clip the gradient L2 norm to this; 0 turns clipping off"
    )
    group.add_argument("--seed", type=int, default=42, help="seed for model initialisation, data order and dropout")
    group.add_argument(
        "--full_determinism", action="store_true", help="deterministic kernels: reruns are identical to the bit"
    )
    group.add_argument("--bf16", action="store_true", help="bfloat16 weights and activations, fp32 master weights")
    group.add_argument(
        "--adam_offload", action="store_true", help="Adam states and step on the CPU (needs --zero_stage >= 1)"
    )
    group.add_argument("--overlap_comm", action="store_true", help="reduce gradients while the backward pass runs")
    group.add_argument("--grad_accum_dtype", choices=["fp32", "bf16", "fp16"], help="dtype gradients accumulate in")
    group.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher; leave it alone")

    group = parser.add_argument_group("model and data")
    group.add_argument("--n_layer", type=int, default=4, help="transformer blocks")
    group.add_argument("--n_head", type=int, default=4, help="attention heads per block; must divide --n_embd")
    group.add_argument("--n_embd", type=int, default=128, help="width of the residual stream")
    group.add_argument("--block_size", type=int, default=128, help="context length in bytes")
    group.add_argument("--dropout", type=float, default=0.0, help="dropout probability in attention and MLP outputs")
    group.add_argument("--data_bytes", type=int, default=2_000_000, help="bytes of standard-library source to read")
    group.add_argument(
        "--val_fraction", type=float, default=0.1, help="last fraction of the bytes, held out for evaluation"
    )

    group = parser.add_argument_group("training")
    group.add_argument(
        "--max_steps",
        type=int,
        default=400,
        help="optimizer steps; the learning-rate schedule spans them. A run resumed with another "
        "--train_batch_size (another number of ranks, with the default) goes on from the steps already taken, "
        "whatever their batch",
    )
    group.add_argument("--learning_rate", type=float, default=3e-3, help="peak learning rate")
    group.add_argument("--warmup_steps", type=int, default=20, help="steps of linear warmup from 0 to the peak")
    group.add_argument("--min_lr_ratio", type=float, default=0.1, help="cosine decay ends at peak * this")
    group.add_argument("--weight_decay", type=float, default=0.1, help="AdamW weight decay on weight matrices")
    group.add_argument("--eval_steps", type=int, default=100, help="evaluate on held-out data every this many steps")
    group.add_argument(
        "--eval_batches",
        type=int,
        default=20,
        help="held-out micro-batches in one evaluation: the same sequences on any number of ranks, shared out",
    )
    group.add_argument("--logging_steps", type=int, default=50, help="print a log line every this many steps")
    group.add_argument(
        "--metrics_path",
        help="file that every logged step's figures are appended to, as one JSON line (default: metrics.jsonl in "
        "--ckpt_path, beside the checkpoints a resumed run continues from)",
    )
    group.add_argument(
        "--use_tensorboard", metavar="DIR", help="also write the logged figures to TensorBoard event files in DIR"
    )
    group.add_argument(
        "--verbose", action="store_true", help="keep DeepSpeed's own log lines (INFO, every rank) for debugging"
    )

    group = parser.add_argument_group("saving and resuming")
    group.add_argument("--save_path", help="folder for the final consolidated weights (pytorch_model.bin)")
    group.add_argument("--ckpt_path", default="./ckpt", help="folder for training checkpoints")
    group.add_argument("--save_steps", type=int, default=-1, help="save a checkpoint every this many steps; -1 never")
    group.add_argument("--max_ckpt_num", type=int, default=3, help="keep at most this many checkpoints")
    group.add_argument("--max_ckpt_mem", type=float, default=1000, help="keep at most this many GiB of checkpoints")
    group.add_argument(
        "--background_save",
        action="store_true",
        help="a save stops training only to copy the state to CPU memory; a thread writes and commits it",
    )
    group.add_argument(
        "--load_checkpoint", action="store_true", help="resume from the latest checkpoint in --ckpt_path"
    )
    group.add_argument(
        "--stop_at_step",
        type=int,
        default=None,
        help="save a checkpoint and stop at this step, as a job whose time is up would; "
        "the learning-rate schedule still spans --max_steps",
    )
    args = parser.parse_args(argv)
    problem = check_args(args, parser)
    if problem:
        parser.error(problem)
    return args


def check_args(args, parser):
    """What is wrong with the flags, naming the flag, its value and what would work; None if nothing is.

    Everything is checked here, before any process group, so a run that starts also gets to its first step and
    can save at its end. The rank's own files are checked on the ranks that write them."""
    # Launchers export WORLD_SIZE and RANK before the script starts; plain python is one process of rank 0.
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    at_least = {
        "--micro_train_batch_size": (args.micro_train_batch_size, 1),
        "--train_batch_size": (args.train_batch_size or 1, 1),
        "--n_layer": (args.n_layer, 1),
        "--n_head": (args.n_head, 1),
        "--n_embd": (args.n_embd, 1),
        "--block_size": (args.block_size, 1),
        "--data_bytes": (args.data_bytes, 1),
        "--max_steps": (args.max_steps, 1),
        "--warmup_steps": (args.warmup_steps, 0),
        "--eval_steps": (args.eval_steps, 1),
        "--eval_batches": (args.eval_batches, 1),
        "--logging_steps": (args.logging_steps, 1),
        "--max_ckpt_num": (args.max_ckpt_num, 1),
        "--local_rank": (args.local_rank, -1),
        "--weight_decay": (args.weight_decay, 0),
    }
    for flag, (value, low) in at_least.items():
        if not value >= low:  # also catches nan
            return f"{flag} {value} must be at least {low}"
    for flag, value, low, high in (
        ("--dropout", args.dropout, 0, 1),
        ("--val_fraction", args.val_fraction, 0, 1),
        ("--min_lr_ratio", args.min_lr_ratio, 0, 1.0000001),
    ):
        if not low <= value < high:
            return f"{flag} {value} must be at least {low} and below {high:g}"
    if not 0 < args.learning_rate < float("inf"):
        return f"--learning_rate {args.learning_rate} must be a positive number (the default is 3e-3)"
    if not 0 <= args.max_norm < float("inf"):
        return f"--max_norm {args.max_norm} must be a finite number >= 0 (0 turns clipping off)"
    if not 0 < args.max_ckpt_mem < float("inf"):
        return f"--max_ckpt_mem {args.max_ckpt_mem} must be a positive number of GiB"
    if args.n_embd % args.n_head:
        divisors = [n for n in range(1, args.n_embd + 1) if args.n_embd % n == 0]
        nearest = sorted(divisors, key=lambda n: abs(n - args.n_head))[:2]
        options = " or ".join(map(str, sorted(nearest)))
        return f"--n_head {args.n_head} must divide --n_embd {args.n_embd} (try --n_head {options})"
    if args.save_steps != -1 and args.save_steps < 1:
        return f"--save_steps {args.save_steps} must be -1 (never) or at least 1"
    if os.path.isfile(os.path.join(args.ckpt_path, "checkpoint_complete.json")):  # DONE_FILE; torch not yet imported
        parent = os.path.dirname(os.path.abspath(args.ckpt_path))
        return f"--ckpt_path {args.ckpt_path} is one checkpoint, not the folder of checkpoints: pass {parent}"
    if args.use_tensorboard and importlib.util.find_spec("tensorboard") is None:
        return f"--use_tensorboard {args.use_tensorboard} needs the tensorboard package: pip install tensorboard"
    if args.stop_at_step is not None and not 1 <= args.stop_at_step <= args.max_steps:
        return f"--stop_at_step {args.stop_at_step} must be between 1 and --max_steps {args.max_steps}"

    # What get_strategy would refuse once torch is imported, refused here with its reason.
    weights_dtype = "bf16" if args.bf16 else "fp32"
    if args.zero_stage == 0 and args.adam_offload:
        return "--adam_offload needs --zero_stage 1, 2 or 3: ZeRO-Offload moves a rank's optimizer shard to the CPU"
    if args.zero_stage == 0 and args.grad_accum_dtype not in (None, weights_dtype):
        why = f"at stage 0 DeepSpeed accumulates gradients in the weights' dtype ({weights_dtype})"
        return f"--grad_accum_dtype {args.grad_accum_dtype} needs --zero_stage 1, 2 or 3: {why}; drop it"
    per_micro_step = args.micro_train_batch_size * world_size
    if args.train_batch_size is None:
        args.train_batch_size = per_micro_step * math.ceil(32 / per_micro_step)
    if args.train_batch_size % per_micro_step:
        lower = args.train_batch_size // per_micro_step * per_micro_step
        options = " or ".join(str(n) for n in (lower, lower + per_micro_step) if n > 0)
        product = f"--micro_train_batch_size * ranks = {args.micro_train_batch_size} * {world_size} = {per_micro_step}"
        return f"--train_batch_size {args.train_batch_size} must be a multiple of {product} (try {options})"
    # The data, from the files' sizes alone: the smallest flag change that makes it fit is named.
    available = sum(os.path.getsize(path) for path in corpus_files())
    if args.data_bytes > available:
        here = f"the {available} bytes of standard-library source here"
        return f"--data_bytes {args.data_bytes} is more than {here} (try {available})"
    train_bytes, val_bytes = split_sizes(args.data_bytes, args.val_fraction)
    sequences = (train_bytes - 1) // args.block_size
    if sequences < args.train_batch_size:
        need = math.ceil((args.train_batch_size * args.block_size + 1) / (1 - args.val_fraction)) + 1
        longest = (train_bytes - 1) // args.train_batch_size
        blocks = f"--block_size {args.block_size} cuts the {train_bytes} training bytes"
        blocks += f" of --data_bytes {args.data_bytes}"
        fixes = [f"--data_bytes {need}" if need <= available else None, f"--block_size {longest}" if longest else None]
        culprit = "--block_size" if args.block_size != parser.get_default("block_size") else "--data_bytes"
        return (
            f"{culprit} is too {'large' if culprit == '--block_size' else 'small'}: {blocks} into {sequences} "
            f"sequences, fewer than one step's --train_batch_size {args.train_batch_size} "
            f"(try {' or '.join(f for f in fixes if f)}, or a smaller --train_batch_size)"
        )
    needed = args.eval_batches * args.micro_train_batch_size
    if (val_bytes - 1) // args.block_size < needed:
        return (
            f"--eval_batches {args.eval_batches} needs {needed} held-out sequences of --block_size {args.block_size} "
            f"and --val_fraction {args.val_fraction} of --data_bytes {args.data_bytes} gives "
            f"{(val_bytes - 1) // args.block_size}: lower --eval_batches, or raise --val_fraction or --data_bytes"
        )

    # Output folders, on the ranks that write them: every rank writes its part of a checkpoint, rank 0 the weights
    # and the metrics.
    saves_checkpoints = args.save_steps > 0 or args.stop_at_step is not None
    args.metrics_path = args.metrics_path or os.path.join(args.ckpt_path, "metrics.jsonl")
    for flag, folder, writes in (
        ("--save_path", args.save_path, rank == 0 and args.save_path is not None),
        ("--ckpt_path", args.ckpt_path, saves_checkpoints),
        ("--metrics_path", os.path.dirname(os.path.abspath(args.metrics_path)), rank == 0),
        ("--use_tensorboard", args.use_tensorboard, rank == 0 and args.use_tensorboard is not None),
    ):
        problem = writes and unwritable(folder)
        if problem:
            return f"{flag} {folder} {problem}: choose a folder this run can write"
    return None


def unwritable(folder):
    """Why this process cannot write files into folder (creating it if need be), or None."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        return "is a file, not a folder"
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as error:
        return f"is not writable ({error.strerror})"


def corpus_files() -> list:
    """The top-level .py files of the standard library, in name order."""
    return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))


def split_sizes(data_bytes: int, val_fraction: float):
    """Training and held-out bytes: the first bytes train, the last val_fraction are held out."""
    cut = int(data_bytes * (1 - val_fraction))
    return cut, data_bytes - cut


if __name__ == "__main__":
    ARGS = parse_args()  # before the imports below, which take seconds
    if not ARGS.verbose:
        # DeepSpeed and torch's extension builder warn on every rank as they load (for example that no GPU was
        # found). A filter set before DeepSpeed creates its logger stays on it; --verbose keeps everything.
        logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from tqdm import tqdm  # noqa: E402

from get_strategy import DONE_FILE, get_strategy  # noqa: E402

# -------------------------------------------------------------------------------------------------------------
# Data: the standard library's own source, as bytes


def load_corpus(max_bytes: int) -> bytes:
    """The first max_bytes of corpus_files(), one after another."""
    return b"".join(open(path, "rb").read() for path in corpus_files())[:max_bytes]


def split_corpus(text: bytes, val_fraction: float):
    """The corpus as two tensors of byte values, split as split_sizes() says (whole files of other modules)."""
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    cut, _ = split_sizes(len(data), val_fraction)
    return data[:cut], data[cut:]


class ByteChunks(torch.utils.data.Dataset):
    """Non-overlapping windows of block_size + 1 bytes: inputs are the first block_size, targets the last."""

    def __init__(self, data: torch.Tensor, block_size: int):
        self.data, self.block_size = data, block_size

    def __len__(self):
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i):
        window = self.data[i * self.block_size : (i + 1) * self.block_size + 1]
        return window[:-1], window[1:]


def unigram_loss(train: torch.Tensor, val: torch.Tensor) -> float:
    """Cross-entropy (nats per byte) of the held-out bytes under the training bytes' frequencies (add-one)."""
    probs = (torch.bincount(train, minlength=256).double() + 1) / (len(train) + 256)
    return -probs.log()[val].mean().item()


# -------------------------------------------------------------------------------------------------------------
# Model: a GPT with 256 byte tokens


class Block(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln_1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.proj(attended.transpose(1, 2).reshape(batch, length, width)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class ByteGPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, block_size, dropout):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(256, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, 256, bias=False)
        for module in self.modules():  # GPT-2's initialisation: small normal weights, zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def model_from_args(args) -> ByteGPT:
    return ByteGPT(args.n_layer, args.n_head, args.n_embd, args.block_size, args.dropout)


def byte_loss(model, x, y, per_sequence=False) -> torch.Tensor:
    """Mean cross-entropy in nats per byte, computed in fp32 also when the model runs in bf16; with per_sequence,
    one mean per sequence of the batch."""
    logits, targets = model(x).float().flatten(0, 1), y.flatten()
    if not per_sequence:
        return F.cross_entropy(logits, targets)
    return F.cross_entropy(logits, targets, reduction="none").view(len(x), -1).mean(1)


# -------------------------------------------------------------------------------------------------------------
# Training helpers


def warmup_cosine(args):
    """Learning-rate multiplier per optimizer step: linear warmup, then cosine decay to min_lr_ratio."""

    def multiplier(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


class Preemption:
    """The signal any rank was sent since this was made: SIGTERM (sent before a job is killed) or SIGUSR1 (SLURM's
    advance notice). Ask received() on every rank after each optimizer step; on a signal the loop saves a
    checkpoint and exits with 128 + it.

    Every rank must stop at the same step, so the ranks reduce their signals (one small all-reduce). But a result
    read on the host waits for everything queued on the device before it: the whole step. So each call starts a
    reduction and answers with the previous call's, finished while this step ran: the run stops one step after the
    signal (a signal during the last step goes unanswered: the run ends anyway), and the host never waits for the
    step under way."""

    def __init__(self, strategy):
        self.strategy, self.signum = strategy, 0
        self.device = get_accelerator().current_device_name()
        self.in_flight = None  # the previous call's result on its way to the host, and the event marking its arrival
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(signum, self.remember)

    def remember(self, signum, frame) -> None:  # a handler only notes the signal; the training loop decides
        self.signum = signum

    def received(self) -> int:
        """The largest signal number any rank had received by the previous call, or 0 (always 0 at the first)."""
        previous = self.in_flight
        # torch.full fills on the device with no copy from the host; non_blocking brings the result back to pinned
        # host memory while the host goes on, and the event marks when it is there.
        reduced = self.strategy.all_reduce(torch.full((), self.signum, device=self.device), "max")
        self.in_flight = (reduced.to("cpu", non_blocking=True), self.recorded_event())
        if previous is None:
            return 0
        on_host, arrived = previous
        if arrived is not None:
            arrived.synchronize()  # until the previous step's end, long past; this step's work stays queued
        return int(on_host)

    def recorded_event(self):
        """An event recorded here on the accelerator's stream; None on the CPU, where a copy is done when it returns."""
        if get_accelerator().Event is None:
            return None
        event = get_accelerator().Event()
        event.record()
        return event


class Metrics:
    """What the loop logs, on rank 0: one JSON line per logged step in the metrics file (FIELDS, null where the step
    did not measure one), and with --use_tensorboard the same as TensorBoard scalars. A resumed run keeps the lines
    up to the step it resumed from and appends after them."""

    FIELDS = ("step", "train_loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "unigram_loss")

    def __init__(self, args, strategy, start_step):
        self.path, self.file, self.tensorboard = args.metrics_path, None, None
        if not strategy.is_rank_0():
            return
        kept = []
        if start_step > 0 and os.path.isfile(self.path):  # the run before this resume wrote these
            kept = [line for line in open(self.path) if json.loads(line)["step"] <= start_step]
        self.file = open(self.path, "w")
        self.file.writelines(kept)
        if args.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(args.use_tensorboard)

    def log(self, step, **figures):
        if self.file is None:
            return
        self.file.write(json.dumps({field: figures.get(field) for field in self.FIELDS} | {"step": step}) + "\n")
        self.file.flush()
        for name, value in figures.items():
            if self.tensorboard is not None:
                self.tensorboard.add_scalar(name, value, step)

    def close(self):
        if self.file is not None:
            self.file.close()
            if self.tensorboard is not None:
                self.tensorboard.close()


def micro_batches(loader, strategy):
    """Micro-batches from where the loader stands (loader.load_state_dict sets it on a resume), epoch after epoch,
    each epoch in a new seeded order and cut to whole optimizer steps. A resume with another --train_batch_size goes on
    at the same sample of the same epoch (on another number of ranks, rounded down to a multiple of the ranks: the
    sampler deals the samples out to them in turn); only where the epoch is cut moves."""
    position = loader.state_dict()  # the epoch and the samples of it already trained on, over all ranks
    epoch, consumed = position["epoch"], position["consumed_samples"]
    while True:
        loader.sampler.set_epoch(epoch, consumed_samples=consumed)
        steps = (len(loader.dataset) - consumed) // strategy.train_batch_size
        yield from itertools.islice(loader, steps * strategy.accumulated_gradient)
        epoch, consumed = epoch + 1, 0


@torch.no_grad()
def evaluate(engine, val_set, strategy, sequences, device) -> float:
    """Mean held-out loss over the first `sequences` held-out sequences, the same whatever the number of ranks:
    rank r takes sequences r, r + world_size, ..., and the ranks add up their sums of losses and counts. Every rank
    runs as many forward passes (at ZeRO 3 each one gathers weights from all ranks), so a rank with fewer
    sequences pads its last micro-batch with sequences that count for nothing."""
    micro, world_size = strategy.micro_train_batch_size, strategy.world_size
    mine = list(range(strategy.get_rank(), sequences, world_size))
    passes = math.ceil(math.ceil(sequences / world_size) / micro)
    totals = torch.zeros(2, device=device)  # the sum of per-sequence losses and their count, on the device
    engine.eval()
    for i in range(passes):
        batch = mine[i * micro : (i + 1) * micro]
        counts = torch.tensor([1.0] * len(batch) + [0.0] * (micro - len(batch)), device=device)
        x, y = (torch.stack(t).to(device) for t in zip(*[val_set[j] for j in batch + [0] * (micro - len(batch))]))
        totals += torch.stack([(byte_loss(engine, x, y, per_sequence=True) * counts).sum(), counts.sum()])
    engine.train()
    totals = strategy.all_reduce(totals, "sum")
    return (totals[0] / totals[1]).item()


@torch.no_grad()
def generate(engine, prompt: bytes, length: int, seed: int, device) -> bytes:
    """Sample length bytes after prompt (temperature 0.8). Every rank draws the same bytes from its own seeded
    generator, since under ZeRO 3 every rank must run each forward pass."""
    engine.eval()
    generator = torch.Generator().manual_seed(seed)
    idx = torch.tensor([list(prompt)], device=device)
    for _ in range(length):
        logits = engine(idx[:, -engine.module.block_size :])[0, -1].float().cpu()
        next_byte = torch.multinomial(F.softmax(logits / 0.8, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, next_byte.to(device).view(1, 1)], dim=1)
    engine.train()
    return bytes(idx[0, len(prompt) :].tolist())


@contextlib.contextmanager
def ops_loading_quietly(verbose: bool):
    """DeepSpeed prints a line on every rank each time it loads one of its compiled ops: keep them off the console
    (--verbose shows them). It says nothing while it compiles one, which the caller reports instead."""
    with contextlib.redirect_stdout(io.StringIO()) if not verbose else contextlib.nullcontext():
        yield


def main(args):
    if not args.verbose:  # DeepSpeed's CPU collectives call torch functions that warn of deprecation at each call
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")

    strategy = get_strategy(args)
    set_up_from = time.perf_counter()
    with ops_loading_quietly(args.verbose):
        strategy.setup_distributed()
    device = get_accelerator().current_device_name()

    train_data, val_data = split_corpus(load_corpus(args.data_bytes), args.val_fraction)
    train_set, val_set = ByteChunks(train_data, args.block_size), ByteChunks(val_data, args.block_size)

    model = model_from_args(args)  # the same initial weights on every rank: setup_distributed seeded torch
    strategy.print(
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {len(train_data):,} training "
        f"bytes, {strategy.world_size} ranks x {strategy.accumulated_gradient} accumulation steps"
    )
    with ops_loading_quietly(args.verbose):  # --adam_offload compiles DeepSpeedCPUAdam on first use
        optimizer = strategy.create_optimizer(
            model, lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=args.weight_decay
        )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args))
    engine, optimizer, scheduler = strategy.prepare((model, optimizer, scheduler))
    if time.perf_counter() - set_up_from > 10:  # measured: 2.1 s with DeepSpeed's ops in the cache
        seconds = time.perf_counter() - set_up_from
        why = "on a machine's first run DeepSpeed compiles its ops (up to a minute each) and caches them for later runs"
        strategy.print(f"set-up took {seconds:.0f} s: {why}")

    # Pinned host memory lets a batch's copy to an accelerator run while the host goes on (non_blocking in the
    # loop); a CPU has nothing to pin it for, and torch warns when asked.
    pinned = get_accelerator().device_name() != "cpu"
    train_loader = strategy.setup_dataloader(train_set, args.micro_train_batch_size, pin_memory=pinned)

    # A step is an optimizer step, whatever its batch: a run resumed with another --train_batch_size goes on from
    # the saved step count, which DeepSpeed's counter and the learning-rate schedule restore too.
    start_step, samples_before = 0, 0
    # Start afresh only where nothing was ever completed: anything else resumes, or stops with the reason.
    started_before = os.path.isdir(args.ckpt_path) and any(
        name == "latest" or os.path.isfile(os.path.join(args.ckpt_path, name, DONE_FILE))
        for name in os.listdir(args.ckpt_path)
    )
    if args.load_checkpoint and started_before:
        load_path, client_state = strategy.load_ckpt(engine, args.ckpt_path)
        start_step, samples_before = engine.global_steps, client_state["consumed_samples"]
        position = client_state.get("data")
        if position is None:  # a checkpoint of an earlier release: only the sum of samples, taken with this batch
            per_epoch = len(train_set) // args.train_batch_size * args.train_batch_size
            epoch, in_epoch = divmod(samples_before, per_epoch)
            position = {"epoch": epoch, "consumed_samples": in_epoch}
        train_loader.load_state_dict(position)
        strategy.print(f"resumed from {os.path.dirname(load_path)} at step {start_step}")
    elif args.load_checkpoint:
        strategy.print(f"no checkpoint in {args.ckpt_path} yet: starting from step 0")

    def save_checkpoint(step):
        started = time.perf_counter()
        tag = f"global_step{step}"  # named here: the folder sized below is the one written
        # The samples trained on since the first step, and where the data stand: the epoch and the samples of it.
        consumed = samples_before + (step - start_step) * args.train_batch_size
        state = {"consumed_samples": consumed, "data": train_loader.state_dict()}
        try:
            strategy.save_ckpt(
                engine,
                args.ckpt_path,
                tag=tag,
                max_num=args.max_ckpt_num,
                max_mem=args.max_ckpt_mem,
                client_state=state,
            )
        except RuntimeError as error:  # every rank raises it alike (a full disk, say): stop here, with its reason
            bar.close()
            strategy.print(f"stopped at step {step}: {error}; make room, then rerun with --load_checkpoint")
            strategy.teardown()
            sys.exit(1)
        seconds = time.perf_counter() - started
        if args.background_save:  # the folder is written while training goes on, and committed after
            log(f"step {step:5d} | checkpoint {tag}: training stopped {seconds:.2f} s, written in the background")
        elif strategy.is_rank_0():  # one rank sizes the folder on the shared filesystem
            folder = os.path.join(args.ckpt_path, tag)
            size = sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder))
            log(f"step {step:5d} | checkpoint {folder}: {size / 1e6:.1f} MB in {seconds:.2f} s")

    def log(message):
        if strategy.is_rank_0():
            tqdm.write(message)  # prints above the progress bar instead of through it

    def held_out_loss(step):
        loss = evaluate(engine, val_set, strategy, args.eval_batches * args.micro_train_batch_size, device)
        log(f"step {step:5d} | held-out loss {loss:.6f}")
        return loss

    preemption = Preemption(strategy)  # listens for SIGTERM and SIGUSR1 from here on
    last_step = min(args.max_steps, args.stop_at_step or args.max_steps)
    unigram, metrics = unigram_loss(train_data, val_data), Metrics(args, strategy, start_step)
    if start_step == 0:
        metrics.log(0, val_loss=held_out_loss(0), unigram_loss=unigram)
    tokens_per_step = args.train_batch_size * args.block_size
    batches = micro_batches(train_loader, strategy)
    bar = tqdm(
        total=args.max_steps, initial=start_step, disable=not strategy.is_rank_0(), desc="train", dynamic_ncols=True
    )
    started, figures = time.perf_counter(), {}  # figures: what a step logs
    for step in range(start_step + 1, last_step + 1):
        # The loss stays on the device: reading a number on the host (.item(), a print) waits for the device to
        # finish its queued work. Outside logging a step reads one number, the previous step's preemption check.
        step_loss = torch.zeros((), device=device)
        for _ in range(strategy.accumulated_gradient):
            x, y = next(batches)
            loss = byte_loss(engine, x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            strategy.backward(loss, engine, optimizer)
            strategy.optimizer_step(optimizer, engine, scheduler)  # steps the optimizer on the last micro-batch
            step_loss += loss.detach() / strategy.accumulated_gradient
        bar.update()
        figures = {}
        if step % args.logging_steps == 0:
            mean_loss = strategy.all_reduce(step_loss).item()  # the mean over ranks: every rank holds the same number
            tokens_per_s = (step - start_step) * tokens_per_step / (time.perf_counter() - started)
            lr = scheduler.get_last_lr()[0]
            bar.set_postfix(loss=f"{mean_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}")
            log(f"step {step:5d} | train loss {mean_loss:.6f} | lr {lr:.3e} | {tokens_per_s:,.0f} tokens/s")
            figures.update(train_loss=mean_loss, lr=lr, grad_norm=strategy.get_grad_norm(engine))
            figures["tokens_per_s"] = tokens_per_s
        if step % args.eval_steps == 0 or step == args.max_steps:
            figures.update(val_loss=held_out_loss(step), unigram_loss=unigram)
        if figures:
            metrics.log(step, **figures)
        saves = (args.save_steps > 0 and step % args.save_steps == 0) or step == args.stop_at_step
        if saves:
            save_checkpoint(step)
        stop = preemption.received()  # every rank agrees, a step after any rank was sent SIGTERM or SIGUSR1
        if stop:
            if not saves:
                save_checkpoint(step)
            bar.close()
            strategy.print(f"stopped by signal {stop} at step {step}; rerun with --load_checkpoint to continue")
            strategy.teardown()
            sys.exit(128 + stop)  # as a process killed by the signal exits, so the scheduler sees an early stop
    bar.close()
    seconds = time.perf_counter() - started
    trained = (last_step - start_step) * tokens_per_step
    strategy.print(f"trained {last_step - start_step} steps in {seconds:.2f} s ({trained / seconds:,.0f} tokens/s)")

    if last_step < args.max_steps:
        strategy.print(f"stopped at step {last_step} of {args.max_steps}; continue with --load_checkpoint")
    else:
        if "val_loss" not in figures:  # a run resumed at its last step trains none
            figures["val_loss"] = held_out_loss(args.max_steps)
        strategy.print(
            f"final held-out loss {figures['val_loss']:.6f} nats/byte; unigram baseline {unigram:.6f} nats/byte"
        )
        sample = generate(engine, b"def ", 160, args.seed, device)
        strategy.print("sample: def " + sample.decode("utf-8", errors="replace"))
        if args.save_path:
            strategy.save_model(engine, None, args.save_path)
            strategy.print(f"weights saved to {os.path.join(args.save_path, 'pytorch_model.bin')}")
    metrics.close()
    strategy.print(f"the logged figures: {args.metrics_path} (python docs/plot_metrics.py draws them)")
    strategy.teardown()


if __name__ == "__main__":
    main(ARGS)
