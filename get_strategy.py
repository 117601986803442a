"""A DeepSpeed training strategy in one file: seeding, distributed set-up, the ds_config for ZeRO 0-3, the
training step, collectives, data loading and checkpoints that resume exactly, also in another run shape.

It imports only the standard library, torch, deepspeed and NumPy (which DeepSpeed requires), so you can copy it
into your own trainer; __version__ below names its release. OpenRLHF's trainers run on it with their import lines
changed (the part "OpenRLHF's contracts", after the learner's part).

Use it in a training script, with args from your argparse parser (it needs --zero_stage, and --local_rank under
the deepspeed launcher):

    strategy = get_strategy(args)
    strategy.setup_distributed()
    optimizer = strategy.create_optimizer(model, lr=1e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # or None; prepare gives it to DeepSpeed
    model, optimizer, scheduler = strategy.prepare((model, optimizer, scheduler))
    for batch in strategy.setup_dataloader(dataset, strategy.micro_train_batch_size):
        loss = loss_fn(model(batch))
        strategy.backward(loss, model, optimizer)  # no loss / accumulation steps, zero_grad() or DDP: the engine's
        strategy.optimizer_step(optimizer, model, scheduler)  # clips and steps once every accumulated_gradient calls
    strategy.teardown()  # ends the process group before Python shuts down

and launch it with `deepspeed train.py`, `torchrun --nproc_per_node N train.py` or plain `python train.py`. On a
machine without a GPU the ranks run on the CPU and talk over gloo.

Batch sizes, as DeepSpeed counts them: train_batch_size = micro_train_batch_size * world_size *
accumulated_gradient. A micro-batch is what one rank puts through one forward and backward pass; the
train_batch_size samples of all ranks and accumulation steps make one optimizer step.

The file has two parts. The first trains, with DeepSpeed: the flags' defaults, get_strategy(), and the strategy's
set-up, ds_config, prepare, backward and step, collectives and data loading. The second, after the line that says a
learner can stop reading, serves OpenRLHF's trainers and keeps a run alive for days: checkpoints, in any run shape.

The ZeRO stages say what each of N ranks keeps of the training state, in bytes per parameter with Adam in mixed
precision (a 16-bit weight 2, its gradient 2, Adam's fp32 master and two moments 12; benchmarks/memory_by_stage.py
measures it). Stage 0, plain data parallelism: everything, 16. Stage 1: its 1/N share of the optimizer state, 4 + 12/N.
Stage 2: also of the gradients, 2 + 14/N. Stage 3: also of the weights, 16/N, gathering each layer's full weights
just while the layer runs. Activations come on top, at every stage.
"""

import atexit
import contextlib
import copy
import gc
import io
import json
import math
import os
import pickle
import random
import re
import resource
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time
import zipfile
import zlib
from datetime import timedelta
from typing import NamedTuple

import deepspeed
import numpy  # DeepSpeed requires it, so vendoring this file adds nothing to install
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

__version__ = "0.23.0"

# -------------------------------------------------------------------------------------------------------------
# Defaults of the flags. get_strategy() reads each flag once, falling back to these; the constructor uses the same
# constants, so every flag's default is written here and nowhere else.
SEED = 42  # seeds Python's random, NumPy and torch; the same on every rank
FULL_DETERMINISM = False  # True: only deterministic kernels, so a rerun is identical to the bit (slower)
MAX_NORM = 1.0  # clip the global L2 norm of the gradients to this before each step; 0 turns clipping off
MICRO_TRAIN_BATCH_SIZE = 1  # samples one rank puts through one forward/backward
TRAIN_BATCH_SIZE = 128  # samples behind one optimizer step, summed over ranks and accumulation steps
ZERO_STAGE = 2  # the constructor's default only: get_strategy() makes the run choose --zero_stage
BF16 = False  # bfloat16 weights and activations; the optimizer keeps fp32 master weights
ADAM_OFFLOAD = False  # keep Adam's states in CPU memory and step them there with DeepSpeedCPUAdam (ZeRO 1-3)
OVERLAP_COMM = False  # reduce gradients while the backward pass still runs: faster, needs more buffer memory
GRAD_ACCUM_DTYPE = None  # dtype gradients accumulate in ("fp32", "bf16", "fp16"); None: the weights' dtype
BACKGROUND_SAVE = False  # save_ckpt returns once the state is copied to CPU memory; a thread writes and commits it
LOCAL_RANK = -1  # -1: take the local rank from the launcher's LOCAL_RANK environment variable


# Where launchers put the world size and this process's rank on its node: torchrun and the deepspeed launcher,
# then MPI launchers (Open MPI, MVAPICH, MPICH and Intel MPI), whose variables exist before DeepSpeed's discovery.
WORLD_SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMI_SIZE")
LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")


# -------------------------------------------------------------------------------------------------------------
# The entry point: a training script calls get_strategy(args) once, then the strategy's methods below.


def get_strategy(args) -> "DeepspeedStrategy":
    """Build the strategy from a trainer's flags (an argparse.Namespace, or any object with attributes): the one
    place flags are read. A flag missing from args takes its default from the block above, except --zero_stage,
    which every run must choose."""
    openrlhf = openrlhf_flags(args)  # OpenRLHF's names for flags, and what it asks for that is left out (part 2)
    if getattr(args, "zero_stage", None) is None:
        fix = "add parser.add_argument('--zero_stage', type=int, choices=[0, 1, 2, 3]) and run with --zero_stage 2"
        raise ValueError(f"--zero_stage is required: {fix}")
    # The constructor's flags besides zero_stage: each one args lacks keeps the constructor's default, the constant
    # of the same name above.
    names = ["seed", "full_determinism", "max_norm", "micro_train_batch_size", "train_batch_size", "bf16"]
    names += ["adam_offload", "overlap_comm", "grad_accum_dtype", "background_save", "local_rank"]
    # Then what OpenRLHF's names give, over them: --param_dtype bf16 turns --bf16 on.
    flags = {name: getattr(args, name) for name in names if hasattr(args, name)} | openrlhf
    return DeepspeedStrategy(zero_stage=args.zero_stage, args=args, **flags)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _first_variable(names):
    """The value of the first of these environment variables that is set, else None."""
    return next((os.environ[name] for name in names if name in os.environ), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DeepspeedStrategy:
    """What a DeepSpeed trainer needs around its model, from set-up to checkpoints. Build it with get_strategy(args)."""

    def __init__(
        self,
        seed=SEED,
        full_determinism=FULL_DETERMINISM,
        max_norm=MAX_NORM,
        micro_train_batch_size=MICRO_TRAIN_BATCH_SIZE,
        train_batch_size=TRAIN_BATCH_SIZE,
        zero_stage=ZERO_STAGE,
        bf16=BF16,
        args=None,  # up to here OpenRLHF's order of arguments; the rest by keyword only
        *,
        adam_offload=ADAM_OFFLOAD,
        overlap_comm=OVERLAP_COMM,
        grad_accum_dtype=GRAD_ACCUM_DTYPE,
        background_save=BACKGROUND_SAVE,
        local_rank=LOCAL_RANK,
    ) -> None:
        # Check every flag that does not need the world size now, so a bad value fails on every rank before any
        # process group exists; setup_distributed() checks the batch sizes against the world size.
        if not _is_int(seed):
            raise ValueError(f"--seed {seed!r} must be a whole number")
        if not (_is_int(zero_stage) and 0 <= zero_stage <= 3):
            stages = "0 (plain data parallel), 1 (shard optimizer states), 2 (and gradients) or 3 (and parameters)"
            raise ValueError(f"--zero_stage {zero_stage!r} is not a ZeRO stage: use {stages}")
        batch_sizes = {"--micro_train_batch_size": micro_train_batch_size, "--train_batch_size": train_batch_size}
        for flag, value in batch_sizes.items():
            if not (_is_int(value) and value >= 1):
                raise ValueError(f"{flag} {value!r} must be a whole number of samples >= 1")
        switches = {"--full_determinism": full_determinism, "--bf16": bf16, "--adam_offload": adam_offload}
        switches.update({"--overlap_comm": overlap_comm, "--background_save": background_save})
        for flag, value in switches.items():
            if not isinstance(value, bool):
                raise ValueError(f"{flag} {value!r} must be True or False (an argparse store_true flag)")
        if not (_is_number(max_norm) and 0 <= max_norm < math.inf):
            raise ValueError(f"--max_norm {max_norm!r} must be a finite number >= 0 (0 turns gradient clipping off)")
        if grad_accum_dtype not in (None, "fp32", "bf16", "fp16"):
            raise ValueError(f"--grad_accum_dtype {grad_accum_dtype!r} must be fp32, bf16 or fp16, or left unset")
        # At stage 0 bf16 keeps fp32 master weights for the update, but its gradients stay in bf16 (DeepSpeed
        # 0.19.8's get_data_types), and DeepSpeed raises NotImplementedError for any other accumulation dtype.
        weights_dtype = "bf16" if bf16 else "fp32"
        if zero_stage == 0 and grad_accum_dtype not in (None, weights_dtype):
            why = f"at stage 0 DeepSpeed accumulates gradients in the weights' dtype ({weights_dtype})"
            raise ValueError(f"--grad_accum_dtype {grad_accum_dtype!r} needs --zero_stage 1, 2 or 3: {why}; drop it")
        if adam_offload and zero_stage == 0:
            why = "ZeRO-Offload moves each rank's shard of the optimizer to the CPU, and stage 0 does not shard it"
            raise ValueError(f"--adam_offload True needs --zero_stage 1, 2 or 3: {why}")
        if not (_is_int(local_rank) and local_rank >= -1):
            raise ValueError(f"--local_rank {local_rank!r} must be -1 (read LOCAL_RANK) or a device index >= 0")

        self.args = args  # the trainer's own flags, kept for trainers that read strategy.args
        # The flags, under their names (the ZeRO stage as stage, which OpenRLHF's trainers read).
        self.seed, self.full_determinism, self.max_norm = seed, full_determinism, max_norm
        self.stage, self.bf16, self.adam_offload = zero_stage, bf16, adam_offload
        self.micro_train_batch_size, self.train_batch_size = micro_train_batch_size, train_batch_size
        self.overlap_comm, self.grad_accum_dtype, self.background_save = overlap_comm, grad_accum_dtype, background_save
        self.local_rank = local_rank  # setup_distributed() replaces -1 with the launcher's value
        # Known after setup_distributed(): the world size, and the micro-steps per optimizer step.
        self.world_size, self.accumulated_gradient = None, None
        self.pending_save = None  # a background save_ckpt in flight (the second part's BackgroundSave)
        self.save_group = None  # the process group of background saves, made at the first
        self.is_rlhf = False  # set by prepare(); OpenRLHF's trainers read it
        self.ema_calls = 0  # moving_average()'s (update_ema counts them)

    # ---------------------------------------------------------------------------------------------------------
    # Seeding and distributed set-up

    def set_seed(self, seed: int) -> None:
        """Seed every generator a training step draws from, alike on every rank, so all build the same model."""
        random.seed(seed)
        numpy.random.seed(seed)
        torch.manual_seed(seed)  # the CPU generator and those of every visible accelerator

    def setup_distributed(self, timeout: timedelta = timedelta(minutes=60)) -> None:
        """Seed, join the process group, derive the accumulation steps and pick this rank's device, under the deepspeed
        launcher, torchrun, MPI launchers or plain python (one process). Called again, it reseeds, in the same group."""
        self.set_seed(self.seed)
        self.timeout = timeout  # the process group's; a background save's group of its own takes it too
        if self.full_determinism:
            self._use_deterministic_kernels()
        if not any(name in os.environ for name in WORLD_SIZE_VARS):
            self._describe_a_one_process_world()
        if self.local_rank != -1:  # the deepspeed launcher passes --local_rank; it wins over the environment
            os.environ["LOCAL_RANK"] = str(self.local_rank)
        if get_accelerator().device_name() == "cuda" and get_accelerator().device_count() == 1:
            # A launcher that shows each process one GPU (srun --gpus-per-task, MPI wrappers): DeepSpeed binds
            # cuda:LOCAL_RANK, which exists only as 0 there.
            os.environ["LOCAL_RANK"] = "0"
        if not dist.is_initialized():
            # Check the batch sizes against the world size the launcher (or the lines above) set, before the
            # rendezvous: a rank that raised inside it would leave the others waiting for the whole timeout.
            self._set_world_size(int(_first_variable(WORLD_SIZE_VARS)))
            self._join_process_group(timeout)
        self._set_world_size(dist.get_world_size())
        # Only now is the local rank known under every launcher (MPI's is found while joining): it picks this
        # rank's device.
        self.local_rank = int(_first_variable(LOCAL_RANK_VARS) or 0)
        get_accelerator().set_device(self.local_rank)  # CUDA: this rank's GPU; CPU: nothing to pick

    def _use_deterministic_kernels(self) -> None:
        # cuBLAS splits reductions according to its workspace; a fixed workspace makes matmuls repeatable. It is
        # read when the first cuBLAS handle is made, which is why this runs before any CUDA work.
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        # flash-attention's backward adds with atomics unless told not to (read by flash-attn and transformers).
        os.environ["FLASH_ATTENTION_DETERMINISTIC"] = "1"
        torch.use_deterministic_algorithms(True)  # raise instead of silently running a nondeterministic kernel
        # Not NaN in every torch.empty, as that switch does: ZeRO 1-2's 2 GB buckets, every micro-step (seconds).
        torch.utils.deterministic.fill_uninitialized_memory = False
        torch.backends.cudnn.deterministic = True  # only deterministic convolution algorithms
        torch.backends.cudnn.benchmark = False  # no timing-based choice of algorithm, which varies run to run

    def _describe_a_one_process_world(self) -> None:
        # Launchers export the rendezvous variables. Without one (plain python), describe a world of one process
        # ourselves, or deepspeed.init_distributed() goes looking for MPI. srun sets none of them: its tasks would
        # each train alone, writing the same checkpoints.
        tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", 1))
        if tasks > 1:
            launch = "srun --ntasks-per-node 1 torchrun --nnodes $SLURM_NNODES --nproc_per_node <GPUs per node>"
            fix = f"{launch} --rdzv_backend c10d --rdzv_endpoint <first node>:29500 train.py"
            why = f"srun started {tasks} tasks of plain python, each a world of one"
            raise ValueError(f"{why}: start one launcher per node, {fix}")
        for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(name, value)
        os.environ.setdefault("MASTER_PORT", str(_free_port()))

    def _join_process_group(self, timeout: timedelta) -> None:
        """Join the process group: nccl on CUDA; gloo on CPU (with DeepSpeed's shared-memory all-reduce within a host).
        Under mpirun DeepSpeed finds the ranks here. A taken port or a missing rank becomes an error saying the fix."""
        env, backend = os.environ, get_accelerator().communication_backend_name()
        where = f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}"
        try:
            if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                self._join_through_torchruns_store(backend, timeout)  # DeepSpeed then adopts this process group
            deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
        except dist.DistStoreError as error:  # a timeout, saying how many ranks arrived
            fix = "check that all were started with the same --master_addr and --master_port"
            raise RuntimeError(f"not every rank arrived at {where} within {timeout} ({error}): {fix}") from error
        except RuntimeError as error:  # a DistNetworkError (torch 2.6: a RuntimeError)
            if "EADDRINUSE" not in str(error):  # torch names no other cause; this one is common on shared machines
                raise
            fix = f"--master_port {_free_port()} (the deepspeed launcher and torchrun both take it)"
            raise RuntimeError(f"port {where} is already in use, perhaps by another run here: try {fix}") from error

    def _join_through_torchruns_store(self, backend: str, timeout: timedelta) -> None:
        # torchrun keeps one store across restarts: this attempt's keys get a prefix of their own, or a restarted
        # rank reads the addresses of dead ranks.
        env = os.environ
        agent = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
        store = dist.PrefixStore(f"attempt{env['TORCHELASTIC_RESTART_COUNT']}/", agent)
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)

    def _set_world_size(self, world_size: int) -> None:
        """Check the batch sizes against world_size, then keep it and the accumulation steps they give."""
        samples_per_micro_step = self.micro_train_batch_size * world_size
        if self.train_batch_size % samples_per_micro_step:
            lower = self.train_batch_size // samples_per_micro_step * samples_per_micro_step
            options = " or ".join(str(n) for n in (lower, lower + samples_per_micro_step) if n > 0)
            product = f"{self.micro_train_batch_size} * {world_size} = {samples_per_micro_step}"
            why = f"must be a multiple of --micro_train_batch_size * world_size = {product}"
            raise ValueError(f"--train_batch_size {self.train_batch_size} {why} (try {options})")
        self.world_size, self.accumulated_gradient = world_size, self.train_batch_size // samples_per_micro_step

    def teardown(self) -> None:
        """Wait for every rank, destroy the process group and collect garbage: call it once when the run is over.
        Without it a multi-rank run can abort at exit ("terminate called without an active exception"): a gloo
        thread releasing DeepSpeed's last collective needs the interpreter lock, which Python's shutdown ends."""
        try:
            wait_for_save(self)  # a background save_ckpt still writing (the file's second part)
        finally:
            if dist.is_initialized():
                dist.barrier()
                dist.destroy_process_group()
            gc.collect()

    # ---------------------------------------------------------------------------------------------------------
    # DeepSpeed configuration: the ds_config dict deepspeed.initialize() reads. Left at DeepSpeed's defaults, and the
    # first knobs to tune: the buckets ZeRO 1-2 reduce gradients in (reduce_bucket_size, allgather_bucket_size: 5e8
    # elements; smaller saves memory, larger overlaps better), ZeRO 3's stage3_param_persistence_threshold (1e5
    # elements: smaller parameters stay whole on every rank) and stage3_prefetch_bucket_size (gathered ahead of the
    # forward). They trade memory for speed on one model and network; no value suits every run, so none is written.

    def get_ds_train_config(self, is_actor: bool = False) -> dict:
        """The ds_config of a model that trains. is_actor is accepted for OpenRLHF's callers and changes nothing."""
        zero = {"stage": self.stage}  # what each rank keeps of the training state (the module docstring)
        # ZeRO-Offload: keep this rank's optimizer shard in CPU memory and run Adam there (DeepSpeedCPUAdam).
        zero["offload_optimizer"] = {"device": "cpu" if self.adam_offload else "none", "pin_memory": True}
        # Reduce gradient buckets while the backward pass still runs. Written only when asked for, as OpenRLHF does:
        # unwritten, DeepSpeed's default for the stage holds (on at ZeRO 3, off below).
        if self.overlap_comm:
            zero["overlap_comm"] = True
        config = self._ds_config(zero)
        config["gradient_clipping"] = self.max_norm  # clip the global gradient L2 norm to this; 0 disables clipping
        if self.grad_accum_dtype is not None:
            config["data_types"] = {"grad_accum_dtype": self.grad_accum_dtype}  # dtype gradients are summed in
        return config

    def get_ds_eval_config(self, offload: bool = False) -> dict:
        """The ds_config of a frozen model (a reference or reward model): no optimizer, no gradients. Only ZeRO 3
        saves memory without an optimizer, so the stage is 3 when training uses 3 and 0 otherwise. offload keeps the
        weights in CPU memory between uses (at ZeRO 3; below it every rank holds the whole model, and it is ignored)."""
        zero = {"stage": 3 if self.stage == 3 else 0}  # shard the weights only when training does
        if offload and self.stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}  # ZeRO 3: fetch weights from CPU per layer
        return self._ds_config(zero)

    def _ds_config(self, zero: dict) -> dict:
        """What the train and eval configs share, around their zero_optimization section."""
        return {
            "train_micro_batch_size_per_gpu": self.micro_train_batch_size,  # samples per rank per forward/backward
            # Samples per optimizer step; DeepSpeed derives the accumulation steps as this / (micro * world size).
            # An eval engine never steps, but DeepSpeed checks the batch sizes there too.
            "train_batch_size": self.train_batch_size,
            # zero, and a key read at ZeRO 3 only: it lets DeepSpeed's own engine.save_16bit_model() gather the full
            # weights, for trainers that call it (save_model gathers them itself).
            "zero_optimization": zero | {"stage3_gather_16bit_weights_on_model_save": True},
            "bf16": {"enabled": self.bf16},  # bfloat16 weights and activations, fp32 master weights for the update
            "steps_per_print": 1 << 30,  # DeepSpeed's own periodic log, effectively off: the trainer reports progress
            "wall_clock_breakdown": False,  # no per-phase timers, which synchronise the device to read time
        }

    # ---------------------------------------------------------------------------------------------------------
    # Optimizer, prepare, backward and step. prepare() wraps a model in a DeepSpeedEngine: deepspeed.initialize()
    # returns (engine, optimizer, training dataloader, scheduler), the optimizer DeepSpeed's wrapper around yours
    # (at ZeRO 1-3 it keeps the fp32 masters and the rank's shards) and no dataloader unless given data. The engine
    # is a torch.nn.Module holding yours (engine.module): calling it runs your forward (at ZeRO 3 gathering each
    # layer's weights just before it runs), engine.train() and engine.eval() switch your module's mode, and its
    # backward() and step() replace loss.backward() and optimizer.step(). A model too large for one device is built
    # already sharded, under `with deepspeed.zero.Init(config_dict_or_path=strategy.get_ds_train_config()):`, as
    # Hugging Face's from_pretrained does at ZeRO 3; create_optimizer and prepare take it as it is.
    # A method reaches the engine through engine_of(model): the engine itself, or the one an OpenRLHF "Actor" (a
    # module keeping its model in `.model`) holds; the part "OpenRLHF's contracts", after the marker, has it.

    def _unwrap_model(self, model) -> torch.nn.Module:
        """The plain module inside an engine, an OpenRLHF Actor, or both (OpenRLHF's trainers call it too)."""
        engine = engine_of(model)
        return engine.module if isinstance(engine, deepspeed.DeepSpeedEngine) else engine

    def create_optimizer(self, model: torch.nn.Module, **kwargs) -> torch.optim.Optimizer:
        """AdamW with weight decay on weight matrices and embeddings, none on biases and norm weights (parameters
        of fewer than two dimensions); kwargs go to the optimizer. The model may already be sharded: built under
        deepspeed.zero.Init (as Hugging Face's from_pretrained does at ZeRO 3), or prepared. With adam_offload,
        DeepSpeedCPUAdam (compiled on first use); on CUDA torch's fused AdamW; elsewhere torch's AdamW."""
        weight_decay = kwargs.pop("weight_decay", 0.0)
        params = [p for p in self._unwrap_model(model).parameters() if p.requires_grad]
        # Dimensions of the full shape: between uses a ZeRO 3 parameter's own shape is (0,), its full one ds_shape.
        decay = [p for p in params if len(getattr(p, "ds_shape", p.shape)) >= 2]
        no_decay = [p for p in params if len(getattr(p, "ds_shape", p.shape)) < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        # No empty group: DeepSpeed would drop it, leaving a scheduler built on this optimizer one group too many.
        groups = [group for group in groups if group["params"]]
        if self.adam_offload:
            return deepspeed.ops.adam.DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
        if get_accelerator().device_name() == "cuda" and "foreach" not in kwargs:
            kwargs.setdefault("fused", True)  # one kernel for the whole step; a caller's fused= or foreach= wins
        return torch.optim.AdamW(groups, **kwargs)

    def prepare(self, *models_or_model_optim_pairs, is_rlhf: bool = False):
        """Wrap models in DeepSpeed engines. A (model, optimizer, scheduler) tuple trains: it becomes
        (engine, optimizer, scheduler) with the train config, and DeepSpeed steps the scheduler (which may be
        None) once per optimizer step. A bare model becomes an eval engine with the eval config. One argument
        returns one result; several return a list in the same order."""
        self._require_process_group("prepare")
        self.is_rlhf = is_rlhf
        prepared = []
        for item in models_or_model_optim_pairs:
            if not isinstance(item, tuple):
                prepared.append(self._init_eval_engine(item) if item is not None else None)
            elif len(item) != 3:
                fix = "pass None as the scheduler if there is none"
                raise ValueError(f"prepare() takes (model, optimizer, scheduler) tuples, got {len(item)} items; {fix}")
            else:
                prepared.append(self._init_train_engine(*item) if item[0] is not None else (None, None, None))
        return prepared[0] if len(prepared) == 1 else prepared

    def _init_train_engine(self, model, optimizer, scheduler):
        if optimizer is None:
            fix = "strategy.create_optimizer(model), or pass the bare model for an eval engine"
            raise ValueError(f"prepare((model, optimizer, scheduler)) trains and needs an optimizer: {fix}")
        refuse_what_prepare_cannot_wrap(model, optimizer, self.adam_offload)
        # The optimizer's groups by parameter name, before DeepSpeed regroups them: save_ckpt records them, since
        # a ZeRO 0 checkpoint keys Adam's state by position alone.
        names = {id(p): name for name, p in engine_of(model).named_parameters()}
        # DeepSpeed drops empty groups.
        group_names = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups if group["params"]]
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=engine_of(model), optimizer=optimizer, lr_scheduler=scheduler, config=self.get_ds_train_config()
        )
        engine.param_group_names = group_names
        return in_actor(model, engine), optimizer, scheduler

    def _init_eval_engine(self, model):
        refuse_what_prepare_cannot_wrap(model)
        # OpenRLHF marks a frozen model whose weights may live in CPU memory with an `_offload` attribute.
        config = self.get_ds_eval_config(offload=getattr(model, "_offload", False))
        return in_actor(model, deepspeed.initialize(model=engine_of(model), config=config)[0])  # [0]: the engine

    def backward(self, loss: torch.Tensor, model, optimizer, **kwargs) -> None:
        """Backward through the engine. It divides the loss by the accumulation steps, so the summed gradients are
        the mean over the whole batch, and averages the gradients over ranks:
        - ZeRO 0: one all-reduce of every gradient, on the last micro-step of an accumulation;
        - ZeRO 1: then too, each gradient reduced only to the rank owning its shard of the optimizer;
        - ZeRO 2 and 3 (each rank keeps only its shard of the gradients): on every micro-step, bucket by bucket
          while the backward pass still runs where overlap_comm is on (DeepSpeed's default at ZeRO 3)."""
        engine_of(model).backward(loss)

    def optimizer_step(self, optimizer, model, scheduler, name: str = "model", **kwargs) -> None:
        """One micro-step of the engine: on the last micro-step of an accumulation it clips the gradients to
        max_norm, steps the optimizer and the scheduler, and zeroes the gradients; otherwise it only counts it.
        The engine holds its optimizer and scheduler: the other arguments are OpenRLHF's signature (so in backward)."""
        engine = engine_of(model)
        if self.stage == 0 and not self.bf16 and engine.is_gradient_accumulation_boundary():
            # Here alone DeepSpeed's step clips without keeping the norm (its clip_grad_norm_ returns it, unread),
            # so get_grad_norm's is taken first, from the gradients backward() has already averaged over ranks.
            grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
            engine.stage0_grad_norm = torch.nn.utils.get_total_norm(grads).item()
        engine.step()

    def get_grad_norm(self, model) -> float:
        """The global L2 norm of the gradients of the last optimizer step, before clipping; 0.0 before the first step,
        as OpenRLHF's own strategy returns (its trainers log it after every micro-step). ZeRO 1-3 and bf16 compute it
        to clip and keep it (engine.get_global_grad_norm()); at fp32 ZeRO 0, optimizer_step computes it."""
        engine = engine_of(model)
        fp32_stage0 = self.stage == 0 and not self.bf16
        norm = getattr(engine, "stage0_grad_norm", None) if fp32_stage0 else engine.get_global_grad_norm()
        return 0.0 if norm is None else float(norm)

    # ---------------------------------------------------------------------------------------------------------
    # Rank helpers and collectives

    def print(self, *msg) -> None:
        """print() on global rank 0 only."""
        if self.is_rank_0():
            print(*msg)

    def is_rank_0(self) -> bool:
        return self.get_rank() == 0

    def get_rank(self) -> int:
        """The global rank; 0 before the process group exists."""
        return dist.get_rank() if dist.is_initialized() else 0

    def all_reduce(self, data, op: str = "mean"):
        """Reduce a tensor, a Python number or a dict of them over all ranks with "mean", "max" or "sum". Returns
        the same kind (a tensor on its own device, a number, a dict paired by key); the caller's tensors stay as
        they are. Bools and integers reduce exactly: a sum is an int64 count, a mean float64, a max keeps the dtype."""
        if op not in ("mean", "max", "sum"):
            raise ValueError(f"all_reduce op {op!r} must be 'mean', 'max' or 'sum'")
        self._require_process_group("all_reduce")
        if isinstance(data, dict):
            return self._for_each_key(data, "all_reduce", lambda value: self.all_reduce(value, op))
        if not isinstance(data, torch.Tensor):  # a Python bool, int or float: float64 for a float, exact otherwise
            data = torch.tensor(data, dtype=torch.float64 if isinstance(data, float) else None)
            return self.all_reduce(data, op).item()
        # Bools and integers reduce as int64: torch's NCCL group sums bool tensors as a max (a logical or), which
        # would say whether any rank had True, not how many.
        exact = not data.is_floating_point() and not data.is_complex()
        dtype = torch.int64 if exact else data.dtype
        tensor = data.detach().to(get_accelerator().current_device_name(), dtype, copy=True)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        if op == "mean":
            tensor = (tensor.double() if exact else tensor) / self.world_size
        elif op == "max":
            tensor = tensor.to(data.dtype)
        return tensor.to(data.device)

    def all_gather(self, data):
        """Gather a tensor, a Python number or a dict of them from all ranks, concatenated along the first
        dimension in rank order (a number or 0-d tensor becomes a tensor of world_size elements). The first
        dimension may differ between ranks; the other dimensions and the dtype may not."""
        self._require_process_group("all_gather")
        if isinstance(data, dict):
            return self._for_each_key(data, "all_gather", self.all_gather)
        if not isinstance(data, torch.Tensor):
            data = torch.tensor([data], dtype=torch.float64 if isinstance(data, float) else None)
        # Rows along the first dimension; a 0-d tensor becomes one row.
        local = data.detach().to(get_accelerator().current_device_name()).reshape(-1, *data.shape[1:])
        shapes = [None] * self.world_size
        dist.all_gather_object(shapes, (tuple(local.shape), str(local.dtype)))
        if len({(shape[1:], dtype) for shape, dtype in shapes}) > 1:
            raise ValueError(f"all_gather: only the first dimension may differ between ranks; (shape, dtype): {shapes}")
        # Collectives move equal sizes: pad every rank's rows to the longest, then cut each back.
        longest = max(shape[0] for shape, _ in shapes)
        padded = torch.cat([local, local.new_zeros(longest - len(local), *local.shape[1:])])
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded)
        return torch.cat([rows[: shape[0]] for rows, (shape, _) in zip(gathered, shapes)]).to(data.device)

    def _for_each_key(self, data: dict, what: str, collective) -> dict:
        """{key: collective(value)} for a dict, in its order. Every rank runs the collectives in sorted key order,
        once each is known to hold the same keys: otherwise unrelated values would pair."""
        keys = sorted(data, key=repr)
        every_rank = [None] * self.world_size
        dist.all_gather_object(every_rank, [repr(key) for key in keys])
        if any(rank_keys != every_rank[0] for rank_keys in every_rank):
            raise ValueError(f"{what} of a dict needs the same keys on every rank; got per rank: {every_rank}")
        results = {key: collective(data[key]) for key in keys}
        return {key: results[key] for key in data}

    def _require_process_group(self, what: str) -> None:
        if self.world_size is None or not dist.is_initialized():
            raise RuntimeError(f"call strategy.setup_distributed() before strategy.{what}()")

    # ---------------------------------------------------------------------------------------------------------
    # Checkpoints and model weights: each call hands its work to a Checkpoints, in the file's second part.

    def save_ckpt(
        self,
        model,
        save_dir,
        tag=None,
        max_num=3,
        max_mem=1000,
        client_state=None,
        save_latest=True,
        metric_value=None,
        metric_key=None,
        background=None,
    ) -> None:
        """Save a checkpoint that resumes exactly, in save_dir/tag (default global_step<N>), keeping at most max_num
        checkpoints and max_mem GiB. All ranks call it (Checkpoints.save: what is kept, and what a failure leaves).
        background (None: the --background_save flag) returns once the state is copied to CPU memory, and the
        checkpoint is written and committed while training goes on."""
        background = self.background_save if background is None else background
        options = dict(max_num=max_num, max_mem=max_mem, client_state=client_state or {}, save_latest=save_latest)
        options.update(metric_value=metric_value, metric_key=metric_key, background=background)
        Checkpoints(self, model, "save_ckpt").save(save_dir, tag, **options)

    def load_ckpt(
        self,
        model,
        load_dir,
        tag=None,
        load_module_strict=True,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_only=False,
    ):
        """Resume load_dir's newest checkpoint (or tag) in this run's shape, whatever the saving run's; returns
        (load_path, client_state), or (None, {}) where load_dir holds none. All ranks call it (Checkpoints.load).
        Load only checkpoints you trust: DeepSpeed unpickles its files, so a crafted one runs code as it loads."""
        options = dict(strict=load_module_strict, load_module_only=load_module_only)
        options.update(load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=load_lr_scheduler_states)
        return Checkpoints(self, model, "load_ckpt").load(load_dir, tag, **options)

    def save_model(self, model, tokenizer, output_dir, **kwargs) -> None:
        """Write the full weights to output_dir, for use outside training (Checkpoints.save_model)."""
        Checkpoints(self, model, "save_model").save_model(tokenizer, output_dir, **kwargs)

    def load_model(self, model, path, map_location="cpu", strict=False, key_replace_fn=None) -> None:
        """Load a state dict file into model, tensors only (Checkpoints.load_model)."""
        Checkpoints(self, model).load_model(path, map_location, strict, key_replace_fn)

    # ---------------------------------------------------------------------------------------------------------
    # OpenRLHF's contracts: what its SFT, reward-model, DPO and PPO trainers use beyond the training path (the
    # part of that name, after the learner's part)

    ring_attn_group = None  # ring attention's process group; OpenRLHF's models read None as "no ring attention"

    def moving_average(self, model, model_ema, beta: float = 0.992, device="cpu") -> None:
        """OpenRLHF PPO's --enable_ema (update_ema, in the part "OpenRLHF's contracts", says what it computes)."""
        update_ema(self, model, model_ema, beta, device)

    # ---------------------------------------------------------------------------------------------------------
    # Data: each rank's shard of a dataset, through the two classes after this one

    def setup_dataloader(
        self,
        dataset,
        batch_size: int,
        pin_memory: bool = False,
        shuffle: bool = True,
        collate_fn=None,
        drop_last=True,
        sampler=None,
        consumed_samples=0,
        num_workers=0,
    ) -> "StatefulDataLoader":
        """A DataLoader over this rank's disjoint shard of dataset (without drop_last, padded with repeats), shuffled
        by seed and epoch. consumed_samples (over all ranks) skips that many samples of the first pass, epoch 0 (a
        whole epoch or more leaves it empty); each later pass is the next epoch. The sampler is the class just below:
        loader.sampler.set_epoch(epoch, consumed_samples) starts an epoch part-way, as a resume past epoch 0 needs.
        The loader is a StatefulDataLoader (the class after it), a DataLoader with state_dict() and load_state_dict()
        to resume mid-epoch, as OpenRLHF's PPO does. num_workers > 0 loads in that many processes, in the same order;
        but a dataset drawing random numbers itself (augmentation) draws others after a resume with workers, which
        torch seeds once per pass: there keep num_workers=0."""
        if sampler is not None and not isinstance(sampler, DistributedSampler):
            why = "the loader resumes mid-epoch (state_dict) through get_strategy's DistributedSampler alone"
            raise ValueError(f"setup_dataloader sampler {type(sampler).__name__} is not get_strategy's: {why}")
        if sampler is None:
            # The process group's shard, even where this strategy has not joined it yet. Without a group (PPO's
            # driver builds its prompts loader before any) a world of one: all the dataset, shuffled by seed and epoch.
            world_size, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
            sampler = DistributedSampler(dataset, world_size, rank, shuffle, self.seed, drop_last, consumed_samples)
        # Its own generator: starting an epoch would otherwise draw from the global torch generator and shift every
        # random number after it (dropout masks), so a resumed run would diverge.
        generator = torch.Generator().manual_seed(self.seed)
        options = dict(collate_fn=collate_fn, pin_memory=pin_memory, drop_last=drop_last, num_workers=num_workers)
        return StatefulDataLoader(dataset, batch_size, sampler=sampler, generator=generator, **options)


class DistributedSampler(torch.utils.data.DistributedSampler):
    """torch's DistributedSampler, under the name and signature OpenRLHF's trainers import, that can start an epoch
    part-way: set_epoch(epoch, consumed_samples) skips its first consumed_samples samples (over all ranks)."""

    def __init__(self, dataset, num_replicas, rank, shuffle, seed, drop_last, consumed_samples=0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.set_epoch(0, consumed_samples)

    def set_epoch(self, epoch: int, consumed_samples: int = 0) -> None:
        super().set_epoch(epoch)
        self.skip = consumed_samples // self.num_replicas
        self.epoch_was_set = True

    def __iter__(self):
        # A trainer that calls set_epoch before each pass gets that epoch; one that never does gets the next
        # epoch on every pass after the first, so its order still changes.
        if not self.epoch_was_set:
            self.set_epoch(self.epoch + 1)
        self.epoch_was_set = False
        return iter(list(super().__iter__())[self.skip :])

    def __len__(self) -> int:
        return max(0, self.num_samples - self.skip)


# A loader's own state, for a resume in the middle of an epoch (OpenRLHF's PPO checkpoints it with client_state).
class StatefulDataLoader(torch.utils.data.DataLoader):
    """A DataLoader that resumes mid-epoch, under the name and the two methods of torchdata's (OpenRLHF's PPO
    checkpoints its state): after load_state_dict(the state_dict() taken after k batches), a loader set up alike
    yields what this one yields after those k, in order, through the following epochs too. The state is plain ints
    (the next pass's epoch and its consumed samples, over all ranks), so it fits a checkpoint's client_state."""

    yielded = None  # batches of the pass under way; None between passes

    def __iter__(self):
        # A generator, to count the batches handed out (not those that worker processes have already loaded ahead).
        self.yielded = 0
        for batch in super().__iter__():
            self.yielded += 1
            yield batch
        self.yielded = None

    def state_dict(self) -> dict:
        sampler = self.sampler
        if sampler.epoch_was_set:  # set_epoch (or load_state_dict) has chosen the next pass
            return {"epoch": sampler.epoch, "consumed_samples": sampler.skip * sampler.num_replicas}
        if self.yielded is None:  # a pass has ended: the next one is the next epoch, from its start
            return {"epoch": sampler.epoch + 1, "consumed_samples": 0}
        seen = sampler.skip + self.yielded * self.batch_size  # this rank's samples of the epoch so far
        return {"epoch": sampler.epoch, "consumed_samples": seen * sampler.num_replicas}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.set_epoch(state["epoch"], state["consumed_samples"])


# ============================================ A learner can stop reading here: everything above trains. ========
# What crosses this line, all defined below: save_ckpt, load_ckpt, save_model, load_model and teardown hand their work
# to the checkpoint part (teardown waits for a background save there, which alone uses the strategy's timeout,
# pending_save and save_group); the methods taking a model reach its engine through engine_of, and prepare returns
# through in_actor (an OpenRLHF Actor's functions, which pass a plain engine through unchanged); get_strategy reads
# OpenRLHF's flags (openrlhf_flags); prepare refuses what DeepSpeed would take wrongly
# (refuse_what_prepare_cannot_wrap); moving_average is update_ema. The second part: OpenRLHF's contracts, then
# checkpoints and model weights, what a run needs to survive being stopped, moved and restarted.


# -------------------------------------------------------------------------------------------------------------
# OpenRLHF's contracts. The strategy's methods are OpenRLHF's DeepspeedStrategy's, up to OpenRLHF 0.10.1 (the last
# release with flat flags), and OpenRLHF's trainers run on this file with their import lines changed. What serves
# them alone is here: the flags they pass that name no flag of the strategy, their "Actor", and the EMA of PPO.

# OpenRLHF's flags for what this file leaves out, with the value meaning "off": get_strategy refuses any other.
LEFT_OUT = {
    "ring_attn_size": (1, "ring attention (sequence parallelism)"),
    "ds_tensor_parallel_size": (1, "DeepSpeed tensor parallelism"),
    "zpg": (1, "ZeRO++ hierarchical weight partitioning"),
    "use_ds_universal_ckpt": (False, "DeepSpeed universal checkpoints"),
    "deepcompile": (False, "DeepSpeed's compiler (deepcompile)"),
    "fp16": (False, "fp16 weights (use --bf16: DeepSpeed's fp16 scales the loss and skips steps)"),
}


def openrlhf_flags(args) -> dict:
    """For get_strategy: refuses OpenRLHF's nested flags (0.10.2 on), a feature this file leaves out, and fp16;
    returns the strategy's flags that OpenRLHF's names give (--param_dtype bf16, from 0.9.2 on, is --bf16)."""
    if hasattr(getattr(args, "ds", None), "zero_stage"):  # args.ds.zero_stage: flags nested by their group
        why = "OpenRLHF 0.10.2 and later nest flags (args.ds.zero_stage), which this file does not read"
        fix = "pass them flat (args.zero_stage), as up to OpenRLHF 0.10.1, or use OpenRLHF's own strategy"
        raise ValueError(f"{why}: {fix}")
    for flag, (off, feature) in LEFT_OUT.items():
        value = getattr(args, flag, off)
        if value != off:
            fix = f"leave it at {off!r}, or use OpenRLHF's own strategy"
            raise ValueError(f"--{flag} {value!r} asks for {feature}, which get_strategy.py does not do: {fix}")
    fp16 = "fp16 is not supported: DeepSpeed's fp16 scales the loss and skips steps, which this file does not do"
    # Only bf16 passes, so --bf16 (a store_true flag, whose False only means "not given") and --param_dtype never
    # disagree.
    param_dtype = getattr(args, "param_dtype", None)
    if param_dtype not in (None, "bf16"):
        raise ValueError(f"--param_dtype {param_dtype!r} must be bf16, or left out for fp32 ({fp16})")
    return {"bf16": True} if param_dtype == "bf16" else {}


# OpenRLHF's "Actor" (the strategy's section on prepare() says how it is used).


def is_actor(model) -> bool:
    """Whether model is an OpenRLHF Actor: a module whose `.model` holds all its parameters. Not a Hugging Face
    model (its `.model` is the backbone; it has save_pretrained) nor an engine (it forwards `.model` to its
    module). It errs for a module with no save_pretrained whose `.model` holds all its parameters: only that
    `.model` is then wrapped, which trains the same parameters."""
    inner = None if isinstance(model, deepspeed.DeepSpeedEngine) else getattr(model, "model", None)
    if not isinstance(inner, torch.nn.Module) or hasattr(model, "save_pretrained"):
        return False
    return not {id(p) for p in model.parameters()} - {id(p) for p in inner.parameters()}


def engine_of(model):
    """What an Actor wraps (its engine, or before prepare() its model); anything else as it is."""
    return model.model if is_actor(model) else model


def in_actor(model, engine):
    """What prepare() returns: an Actor, now holding the engine; otherwise the engine."""
    if not is_actor(model):
        return engine
    model.model = engine
    return model


def refuse_what_prepare_cannot_wrap(model, optimizer=None, adam_offload=False) -> None:
    """For prepare, which refuses what DeepSpeed would take wrongly or fail on without naming the fix: a module
    torch.compile() wrapped (its names gain "_orig_mod.", and at ZeRO 3 DeepSpeed fails at its first forward), and
    with adam_offload an optimizer other than DeepSpeedCPUAdam (DeepSpeed refuses it, advising ds_config keys)."""
    if hasattr(engine_of(model), "_orig_mod"):  # what torch.compile returns: an OptimizedModule around the model
        fix = "pass the model itself, and compile the engine prepare returns: engine.compile()"
        raise ValueError(f"prepare got a module torch.compile() wrapped: {fix}")
    if adam_offload and not isinstance(optimizer, deepspeed.ops.adam.DeepSpeedCPUAdam):
        why = "--adam_offload steps Adam on the CPU with DeepSpeedCPUAdam, which load_ckpt resumes, and prepare got"
        fix = "build it with strategy.create_optimizer(model, lr=..., weight_decay=...) (no decay on biases and norms)"
        raise ValueError(f"{why} {type(optimizer).__name__}: {fix}, or drop --adam_offload")


def update_ema(strategy, model, model_ema, beta: float, device) -> None:
    """strategy.moving_average(), called after optimizer_step: on every accumulated_gradient-th call (once per
    optimizer step) each weight of model_ema whose counterpart in model trains becomes beta * itself + (1 - beta) *
    that counterpart, computed on device ("cuda", which OpenRLHF passes on any machine: this rank's accelerator). All
    ranks must call it; at ZeRO 3 it gathers one pair of weights at a time."""
    strategy._require_process_group("moving_average")
    strategy.ema_calls += 1
    if strategy.ema_calls % strategy.accumulated_gradient:
        return
    device = get_accelerator().current_device_name() if device == "cuda" else device
    module, ema_module = strategy._unwrap_model(model), strategy._unwrap_model(model_ema)
    for param, ema in zip(module.parameters(), ema_module.parameters(), strict=True):
        # Below ZeRO 3 the gathers do nothing. At ZeRO 3 the EMA weight's gather (modifier_rank=0) writes rank 0's
        # new value back into every rank's shard as it exits.
        if param.requires_grad:
            with deepspeed.zero.GatheredParameters([param]), deepspeed.zero.GatheredParameters([ema], modifier_rank=0):
                ema.data.copy_(beta * ema.data.to(device) + (1 - beta) * param.data.to(device))


# -------------------------------------------------------------------------------------------------------------
# Checkpoints and model weights.
#
# A checkpoint is a folder in save_dir holding four kinds of saved state (their file names: the constants below):
#   - DeepSpeed's model states (mp_rank_00_model_states.pt; at ZeRO 3 one per rank, its own buffers and
#     client_state too): the module's weights, the scheduler, the counters and client_state, and at ZeRO 0 the
#     optimizer's state too;
#   - at ZeRO 1-3 each rank's shard of the optimizer's state (*zero_pp_rank_<rank>_*optim_states.pt);
#   - each rank's random generators (RNG_FILE), which DeepSpeed does not save;
#   - last, the record (DONE_FILE): the run's shape, the model's tensors, the optimizer's groups by name, which
#     slices each rank's optimizer file holds, the metric, and every file's size and content. A folder is a
#     checkpoint once its record is there, not before.
#
# The table: every entry a save_dir can hold, and what load_ckpt(tag=None), save_ckpt and rotation do with it. A
# save or a delete changes one entry at a time, by one rename or one record, so wherever it is cut short (a crash, a
# power cut) save_dir holds rows of this table and nothing else. The rows marked * are working entries: every save
# starts by settling them (step 1 below), so the rotation that ends a save never meets one. The save_ckpt column says
# what a save does to the entry its tag names, but on the rows marked *, which it settles whatever their tag.
#
#     entry in save_dir                what it is                          load_ckpt(tag=None)  save_ckpt    rotation
#     <tag>/ with a record             checkpoint <tag>                    a candidate          replaces it  deletes it
#   * <tag>.saving/ with a record      checkpoint <tag>, newer than a      a candidate, as      renames it   (settled)
#                                      <tag>/ (cut short before renaming)  <tag>                to <tag>
#   * <tag>.saving/ without a record   a save cut short, or under way      ignored              deletes it   (settled)
#                                      (a background save's thread writes)
#   * <name>.deleting/                 a delete cut short                  ignored              deletes it   (settled)
#     <tag>/ without a record          not this file's: a plain DeepSpeed  a plain one refused  refuses it   never
#                                      checkpoint, a folder of yours       by name where no
#                                                                          checkpoint is; yours
#                                                                          ignored
#     a link, anything else            not this file's to change           a candidate if it    refuses it   never
#                                                                          links to one
#     latest (a file)                  the tag to resume, written by save_ckpt (DeepSpeed's own load reads it too)
#     latest.tmp (a file)              a write of latest cut short         ignored              replaces it  never
#
# A save deletes or renames only folders holding checkpoint files alone (CHECKPOINT_FILES), never a link; a delete
# renames the folder to <name>.deleting, then removes its files. Saving, step by step (Checkpoints.save):
#   1. rank 0 settles the rows marked * (a committed <tag>.saving renamed to <tag>, the others deleted), refuses a tag
#      whose folder is not a checkpoint and a save_dir whose newest checkpoint holds another model, and makes
#      <tag>.saving;
#   2. every rank writes its files into <tag>.saving and makes them durable (fsync), noting a failed write instead of
#      raising it (OwnFiles); with background, it copies their state into CPU memory instead, save_ckpt returns, and
#      the steps from here on, the writes included, are its thread's (BackgroundSave);
#   3. the ranks agree on whether any write failed;
#   4. rank 0 writes the record into <tag>.saving, then latest: the save is committed. A failure up to here leaves
#      the previous checkpoint and latest as they were, and every rank removes <tag>.saving;
#   5. rank 0 renames an older <tag> to <tag>.deleting and <tag>.saving to <tag>, removes <tag>.deleting, then
#      rotates; a failure here is a warning.
# Loading, step by step (Checkpoints.load): rank 0 chooses the checkpoint and reads its record, for every rank; each
# rank checks its share of the files, and the ranks agree; another model is refused; each rank reads the slices it
# will hold from the files holding them, in any run shape (ReshapingReader, the file's last part), each checked by
# its size and records first; the generators. A save_ckpt, load_ckpt, save_model, load_model or teardown first waits
# for a background save in flight.
RNG_FILE = "rng_state_rank{rank}.pt"  # each rank's random generators
DONE_FILE = "checkpoint_complete.json"  # the record, written once every rank has saved
STAGING = ".saving"  # save_ckpt writes <tag>.saving, renamed to <tag> once committed
DELETING = ".deleting"  # a folder on its way out: renamed so, then removed
LATEST = "latest"  # the file naming the checkpoint to resume, as DeepSpeed's own load reads it
# The entries DeepSpeed writes into the model states beside client_state, which it merges into them, and those it
# reserves: a client_state key among them would overwrite its state (save_ckpt refuses one), and load_ckpt returns
# client_state without them. UNHELD is this file's own: the parameters that train but no optimizer holds, at ZeRO 3.
UNHELD = "unheld_param_fragments"
RESERVED_KEYS = {UNHELD, "checkpoint_parallel_dimensions", "universal_checkpoint_info", "folding", "num_experts"}
RESERVED_KEYS.update("module buffer_names optimizer param_shapes frozen_param_shapes shared_params".split())
RESERVED_KEYS.update("frozen_param_fragments data_sampler random_ltd skipped_steps global_steps lr_scheduler".split())
RESERVED_KEYS.update("global_samples dp_world_size mp_world_size ds_config ds_version ds_autoep_layers".split())
RESERVED_KEYS.update(["autoep_layers", "sparse_tensor_module_names"])  # the last DeepSpeed 0.17's
# A plain DeepSpeed checkpoint (OpenRLHF's own strategy saves them) has no record to check it by or to read
# another shape with: DeepSpeed's own load takes it in, in its own shape.
PLAIN_FIX = "load it with engine.load_checkpoint(load_dir, tag) in the shape that saved it, then call save_ckpt"
# The files a checkpoint's folder holds: DeepSpeed's, RNG_FILE, and the record with its temporary. A folder holding
# anything else (a file of yours, a subfolder) is never deleted, nor a link.
DEEPSPEED_FILES = r"(bf16_)?(zero_pp_rank_\d+_)?mp_rank_\d+_(model|optim)_states\.pt"
CHECKPOINT_FILES = re.compile(DEEPSPEED_FILES + r"|rng_state_rank\d+\.pt|checkpoint_complete\.json(\.tmp)?")
# The weight files that torch.save and Hugging Face's save_pretrained write, whole or in shards, and their indexes:
# save_model replaces an earlier save's.
WEIGHT_FILES = re.compile(r"(pytorch_model|model)(-\d+-of-\d+)?\.(bin|safetensors)(\.index\.json)?")


def training_optimizer(engine):
    """The engine's optimizer; None in an eval engine (prepare(model)), which at ZeRO 3 holds DeepSpeed's weight
    gatherer, DeepSpeedZeRoOffload, in its place, and in a module that was never prepared."""
    optimizer = getattr(engine, "optimizer", None)
    return None if type(optimizer).__name__ == "DeepSpeedZeRoOffload" else optimizer


def model_states_file(stage: int, rank: int = 0) -> str:
    """The file with the module, the counters and client_state: at ZeRO 3 each rank writes its own (its buffers and
    client_state too), below it rank 0 one for every rank."""
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"


def saving_rank(name: str) -> int:
    """The rank that wrote a checkpoint file, read from its name; 0 for the model states one rank writes for all."""
    found = re.search(r"(?:pp_rank_|state_rank)(\d+)", name)
    return int(found.group(1)) if found else 0


def fsync(path) -> None:
    """Make a file, or a folder's list of names, durable: flushed from the page cache to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def records_digest(archive: zipfile.ZipFile) -> int:
    """The CRC of a torch.save archive's list of records and their CRCs, read from its central directory alone: a
    file of the same size copied from another checkpoint differs here."""
    return zlib.crc32(repr([(info.filename, info.CRC) for info in archive.infolist()]).encode())


def zip_damage(path, digest=None, rank=0, world_size=1):
    """What is damaged in the torch.save archive at path (a zip of uncompressed records, each with its CRC, which
    torch.load does not check), or None: its list of records, against digest where one is given, then the CRC of
    each record that is this rank's share (every world_size-th, largest first, so huge records go to different
    ranks; world_size 0: none). zipfile checks a record's CRC as its last byte is read. A read that fails (EIO,
    ESTALE) is no damage: it raises."""
    try:
        with zipfile.ZipFile(path) as archive:
            if digest is not None and records_digest(archive) != digest:
                return f"{path} is not the file this checkpoint saved (its records differ; copied from another?)"
            records = sorted(archive.infolist(), key=lambda info: -info.file_size)
            for info in records[rank::world_size] if world_size else []:
                if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
                    return f"{path} is damaged (record {info.filename!r} is not stored as torch.save stores it)"
                with archive.open(info) as record:
                    while record.read(1 << 24):  # 16 MiB at a time, however large the tensor
                        pass
    except OSError:
        raise
    except Exception as error:  # whatever zipfile makes of the damage (BadZipFile, zlib.error, ...): named
        return f"{path} is damaged ({error})"
    return None


def is_file(path) -> bool:
    """os.path.isfile, but a read that fails (EIO, ESTALE) raises: a file that cannot be seen is not a missing one."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def saved_file_damage(folder, name, done, world_size=0):
    """What is wrong with the checkpoint's file folder/name against its record done, or None: missing, another
    size, other records (zip_damage's digest), and with world_size 1 the CRC of every record."""
    path, size = os.path.join(folder, name), done["files"][name]
    found = os.path.getsize(path) if is_file(path) else None
    state = "is missing" if found is None else f"has {found} bytes, not the {size} saved"
    problem = f"{path} {state} on {socket.gethostname()}" if found != size else None
    return problem or zip_damage(path, done["contents"].get(name), 0, world_size)


def load_file(path, done=None, **options):
    """torch.load onto the CPU, naming the file in the error where it fails (an I/O error names none). With a
    checkpoint's record (done), once the file's size and records are those it names: a rank whose view of the folder
    is stale (a network filesystem's cache) reads no file of another checkpoint. (The ranks shared the CRCs before.)"""
    problem = done and saved_file_damage(os.path.dirname(path), os.path.basename(path), done)
    if problem:
        raise ValueError(problem)
    try:
        return torch.load(path, map_location="cpu", **options)
    except Exception as error:
        raise RuntimeError(f"reading {path}: {type(error).__name__}: {error}") from error


class DurableWriter(TorchCheckpointEngine):
    """The writer save_ckpt plugs into DeepSpeed where it takes one (engine.checkpoint_engine). While a save_ckpt has
    DeepSpeed save its files, each goes to that save's OwnFiles; outside one (DeepSpeed's own save_checkpoint or
    save_16bit_model, called by you, also while a background save writes) it writes as DeepSpeed's own writer does."""

    files = None  # the OwnFiles of the save_ckpt under way on the calling thread
    buffers = []  # the last background save's copies (OwnFiles.copies), which the next one reuses

    def save(self, state_dict, path: str) -> None:
        if self.files is None:
            return torch.save(state_dict, path)
        self.files.add(state_dict, path)


class OwnFiles:
    """This rank's files of one save_ckpt, in its staging folder, <tag>.saving. Each file is written as DeepSpeed
    hands it over, made durable (fsync) and reported with its size and records' digest, for the record; with
    background, its state is copied into CPU memory instead (snapshot), for write_queued() to write on the save's
    thread. A failed write is noted, and every write after it skipped, instead of raised: raised, it would take this
    rank out of the barriers inside DeepSpeed's save_checkpoint while the others waited there for the process
    group's timeout; noted, it reaches every rank at step 3's agreement (finish, in Checkpoints.save)."""

    def __init__(self, staging, background, rank, buffers, holds):
        self.staging, self.background, self.rank = staging, background, rank
        self.spare = {}  # {size: an earlier background save's copies of that size}, which this save's reuse
        for buffer in buffers:
            self.spare.setdefault(buffer.numel(), []).append(buffer)
        self.holds = holds  # at ZeRO 1-2, {parameter: [first element, length]} its optimizer file holds (the record's)
        self.copies = []  # this save's copies, one per storage, in order
        self.queued = []  # (path, the state as snapshot() copied it), waiting to be written
        self.written = {}  # {file name: [size, records digest]}
        self.failed = None  # what the first write that failed said, naming the rank, the file and the likely cause

    def add(self, state, path) -> None:
        if self.background:
            return self.attempt(path, lambda: self.queued.append((path, self.snapshot(state))))
        self.attempt(path, self.write_file, state, path)

    def attempt(self, path, function, *args) -> None:
        if self.failed is None:
            try:
                function(*args)
            except Exception as error:  # kept as its message: the error's traceback holds the file open
                self.failed = failed_write(path, error, self.rank, os.path.dirname(self.staging))

    def snapshot(self, state):
        """state as it is now, for training to change the original meanwhile: pickled as torch.save pickles it, each
        storage (the memory under one tensor or several) copied once into a CPU buffer, on a GPU without waiting
        (_save_own_files waits once for all, after DeepSpeed's save). So Parameters, requires_grad, one tensor
        under two names and views of one storage come back as a synchronous save's do."""
        indexes = {}  # a storage's identity (_cdata, as torch.save keys it) -> its copy's index

        def persistent_id(value):  # a storage pickles as its copy's index and its dtype; anything else as pickle does
            if not isinstance(value, (torch.storage.TypedStorage, torch.UntypedStorage)):
                return None
            # A tensor pickles its storage as a TypedStorage; those of the newest dtypes (float8, uint16) bare.
            typed = isinstance(value, torch.storage.TypedStorage)
            storage = value._untyped_storage if typed else value
            if storage._cdata not in indexes:
                indexes[storage._cdata] = self.copy(storage)
            return indexes[storage._cdata], value.dtype if typed else torch.uint8

        def persistent_load(saved):  # the copy, typed as the original was (as torch.load types it: bytes if untyped)
            index, dtype = saved
            copied = self.copies[index].untyped_storage()
            return torch.storage.TypedStorage(wrap_storage=copied, dtype=dtype, _internal=True)

        pickled = io.BytesIO()
        pickler = pickle.Pickler(pickled)
        pickler.persistent_id = persistent_id
        pickler.dump(state)
        unpickler = pickle.Unpickler(io.BytesIO(pickled.getvalue()))
        unpickler.persistent_load = persistent_load
        return unpickler.load()

    def copy(self, storage) -> int:
        """Copy storage into this save's next buffer (an earlier save's of its size, if one is spare); its index."""
        index, spare = len(self.copies), self.spare.get(storage.nbytes())
        pinned = get_accelerator().device_name() != "cpu"  # pinned: copied by DMA, without the host waiting
        buffer = spare.pop(0) if spare else torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned)
        buffer.untyped_storage().copy_(storage, non_blocking=True)
        self.copies.append(buffer)
        return index

    def write_file(self, state, path: str) -> None:
        torch.save(state, path)  # a zip archive, as DeepSpeed's own writer saves by default
        fsync(path)  # durable before rank 0 commits
        with zipfile.ZipFile(path) as archive:
            self.written[os.path.basename(path)] = [os.path.getsize(path), records_digest(archive)]

    def write_queued(self):
        """Write what snapshot() copied, make the folder's names durable, and report for the record: (what failed or
        None, {file name: [size, records digest]}, {optimizer file name: holds}). Rank 0's record lists the files the
        ranks report: its own listing of a shared folder can miss another node's files for a while, as NFS's
        attribute cache does."""
        for path, state in self.queued:
            self.attempt(path, self.write_file, state, path)
        self.queued = []
        self.attempt(self.staging, fsync, self.staging)
        if self.failed:
            return self.failed, {}, {}
        optimizer_file = [name for name in self.written if name.endswith("optim_states.pt")]
        return None, self.written, {name: self.holds for name in optimizer_file if self.holds}


def failed_write(path, error, rank, save_dir) -> str:
    """What a write that failed says: the rank, the file, the error, and the two usual causes (torch.save names
    none: an unexpected position in its zip writer)."""
    try:
        why = f"{save_dir} has {shutil.disk_usage(save_dir).free / 2**20:.1f} MiB free"
    except OSError as gone:  # this node lost the folder: say so, still without raising
        why = f"{save_dir} cannot be read here ({gone})"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        why += f", and this process may write files of at most {limit} bytes (ulimit -f)"
    where = f"on rank {rank} ({socket.gethostname()}) writing {path}"
    return f"save_ckpt failed {where}: {error}; {why}; the checkpoint before it is unchanged"


WRITER_NICE = 19  # the background save's thread's CPU priority (Linux nice: 0 as training, 19 the lowest)


class BackgroundSave(threading.Thread):
    """A save_ckpt(background=True) finishing on a thread of its own: Checkpoints.save starts it, wait_for_save alone
    waits for it. Its thread runs finish(): the writes (OwnFiles.write_queued), the agreement with the other ranks'
    threads and rank 0's commit, over a gloo process group of the strategy's own (every rank makes it at its first
    background save), never the training's, whose collectives, the calling thread's, these would interleave with. A
    rank that died is noticed at once (its connection closes); one that hangs, once the group's timeout (the one
    setup_distributed was given) runs out. A failure is printed when it happens, and raised by the next call that
    waits.

    Not a daemon: a process that ends without teardown() (OpenRLHF's trainers do not call it), also by an exception
    or sys.exit() in a signal handler during wait_for_save, finishes the save before the interpreter exits, with
    exit code 1 where it failed (exit_if_a_save_failed_unseen); one killed meanwhile leaves <tag>.saving without a
    record, a row of the table. The thread runs at the lowest CPU priority (nice 19, on Linux a thread's own): its
    writes take the CPU time training leaves."""

    unseen = []  # the failed saves no call has raised yet, for the interpreter's exit

    def __init__(self, finish, group, tag, rank):
        super().__init__(name=f"save_ckpt {tag}")
        self.finish, self.group, self.tag, self.rank = finish, group, tag, rank
        self.problem = None  # what failed, once run() ends
        # Set as the thread's work ends. A wait waits for it, not in Thread.join(): in Python 3.11 an exception
        # that leaves join() (Ctrl-C's KeyboardInterrupt, a signal handler's) marks the running thread stopped, so
        # that no later join() and not the interpreter's exit waits for it (bpo-45274's handler).
        self.done = threading.Event()

    def run(self) -> None:
        if sys.platform == "linux" and threading.current_thread() is self:  # not where wait_for_save runs it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        try:
            self.problem = self.finish(self.group)
        except Exception as error:  # the group failed: a rank died, or did not answer within the group's timeout
            self.problem = f"save_ckpt of {self.tag} failed in the background on rank {self.rank}: {error!r}"
        if self.problem:
            print(f"rank {self.rank}: {self.problem}", flush=True)
            BackgroundSave.unseen.append(self)
        self.done.set()


ARRIVAL_WARNING = timedelta(minutes=1)  # how long a rank waits at a call every rank must make before it goes on
ARRIVALS = {}  # {call: how many times this process made it}: every rank makes such calls in the same order


def wait_to_start(strategy, call=None) -> None:
    """Before a call of the checkpoint part starts: wait for the background save in flight (wait_for_save: one save
    at a time, and it raises at once where a rank died); and where call names one every rank must make (save_ckpt,
    load_ckpt, save_model), wait a while for every rank to make it. For that, each rank appends its number to one key
    of the process group's store, then reads the key until every rank is there. After ARRIVAL_WARNING it says which
    ranks have not come and why they must, and goes on into the call, whose collectives wait for the others (a rank
    only slow fails nothing) or fail at once where one died. A script that saves on rank 0 alone would otherwise hang
    in silence inside DeepSpeed. The store is read, not waited on: a wait would hold its connection, which other
    threads share, until it ends."""
    wait_for_save(strategy)
    if call is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    ARRIVALS[call] = ARRIVALS.get(call, 0) + 1
    key, rank = f"get_strategy/{call}/{ARRIVALS[call]}", dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    store.append(key, f"{rank},")
    started = time.monotonic()
    while True:
        arrived = {int(r) for r in store.get(key).decode().split(",") if r}  # "0,1,": ranks 0 and 1
        missing, waited = sorted(set(range(dist.get_world_size())) - arrived), time.monotonic() - started
        if not missing:
            return
        if waited > ARRIVAL_WARNING.total_seconds():
            rule = f"every rank must call {call}, and at ZeRO 3 run every forward pass (a call on rank 0 alone hangs)"
            print(f"rank {rank} has waited {waited:.0f} s in {call} for ranks {missing}: {rule}", flush=True)
            return
        time.sleep(min(1.0, max(0.001, waited / 2)))  # soon for ranks a moment apart, then once a second


def wait_for_save(strategy) -> None:
    """Wait for the strategy's background save in flight, if any; raise what failed in it (the same on every rank,
    which agreed on it; where the save's process group itself failed, this rank's own account). Interrupted
    (Ctrl-C, a signal handler that raises or exits), the save stays in flight: the next call waits for it again,
    and so does the interpreter's exit."""
    pending = strategy.pending_save
    if pending is not None:
        if pending.ident is None:  # never started (Ctrl-C just before start(), or no thread to be had): run it here
            pending.run()
        pending.done.wait()
        strategy.pending_save = None
        if pending.problem:
            BackgroundSave.unseen.remove(pending)
            raise RuntimeError(pending.problem)


def exit_if_a_save_failed_unseen() -> None:
    """At the interpreter's exit, after it waited for every background save's thread: a save that failed, which no
    call raised, ends the process with exit code 1 (also where the script exited with another), its reason printed
    by the thread. Registered as this file is imported, so that it runs after the exit handlers registered later
    (Python runs the newest first): a script's own (a tracker's final sync) run before it. os._exit, the one way to
    set the code this late, skips those registered before (logging's, whose handlers flush every record anyway)."""
    if BackgroundSave.unseen:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(1)


atexit.register(exit_if_a_save_failed_unseen)


class Checkpoints:
    """What a run writes to disk and reads back for one model (an engine, an Actor or a plain module): its
    checkpoints (save, load) and its full weights (save_model, load_model). The strategy's save_ckpt, load_ckpt,
    save_model and load_model each make one and hand it their arguments."""

    def __init__(self, strategy: DeepspeedStrategy, model, call=None):
        wait_to_start(strategy, call)  # call: the name of a call every rank makes, or None
        self.strategy, self.print = strategy, strategy.print
        self.rank, self.world_size = strategy.get_rank(), strategy.world_size
        # The engine (or the module itself if it was never prepared), and the plain module inside it.
        self.engine, self.module = engine_of(model), strategy._unwrap_model(model)

    # ---------------------------------------------------------------------------------------------------------
    # Saving

    def save(self, save_dir, tag, *, max_num, max_mem, client_state, save_latest, metric_value, metric_key, background):
        """Save a checkpoint that resumes exactly: DeepSpeed's model, optimizer and scheduler states, client_state
        (your loop's counters) and every rank's random generators, in the steps the section's header lists. All
        ranks must call it, save_dir must be on a filesystem every rank sees, and one run saves into it at a time
        (one model too: a save_dir per model). The default tag is global_step<N>. Then checkpoints go until at most
        max_num and max_mem GiB remain (never the new one or latest's): those without a metric_value first, then
        the lowest metric_value (higher is better), then the oldest. As in OpenRLHF 0.10: a tag starting with
        "best" is a best checkpoint, which max_num does not count and rotation never deletes to make room, but
        max_mem counts; only the newest best is kept (rotation deletes the older ones). metric_value (with its
        metric_key, a name) is kept in the checkpoint's record; a NaN or infinite one counts as none, with a warning
        (one evaluation that diverged must not cost a checkpoint).

        With background, it returns once every rank holds a copy of its files' state in CPU memory (step 2 of the
        header), and a thread of this process (BackgroundSave) does the rest: the writes, the fsyncs, and the
        ranks' agreement and the commit over a process group of the strategy's own. The training's process group is
        used by the calling thread alone; the next save_ckpt, load_ckpt, save_model, load_model or teardown first
        waits for it (DeepSpeed's own engine.save_checkpoint, called meanwhile, is the caller's and no part of it).

        A write that fails on any rank (a full disk or quota, an I/O error, a read-only folder) raises on every
        rank, naming the rank, the file, the error and the free space (with background, at that next call), and
        removes what the save wrote; the previous checkpoint and latest stay as they were. An eval engine, a tag
        that cannot name a checkpoint folder, one whose folder is not a checkpoint, a client_state key of
        DeepSpeed's own, and another model's save into this save_dir are refused on every rank before anything is
        written. Not covered: an exception inside DeepSpeed's own save before its last barrier (out of memory in
        the optimizer's state_dict()) leaves the other ranks waiting there."""
        # Refused on every rank before anything is written: a refusal on one rank alone would leave the others waiting.
        if not _is_int(max_num) or max_num < 1:
            raise ValueError(f"save_ckpt max_num {max_num!r} must be a whole number >= 1")
        if not (_is_number(max_mem) and max_mem > 0):  # NaN too
            raise ValueError(f"save_ckpt max_mem {max_mem!r} must be a number of GiB > 0")
        metric, problem = self._metric(metric_value, metric_key)
        if training_optimizer(self.engine) is None and not problem:  # at ZeRO 3 DeepSpeed's save would fail
            problem = "save_ckpt saves an engine that trains, not an eval engine (prepare(model)): use save_model"
        reserved = [key for key in client_state if key in RESERVED_KEYS]
        if reserved and not problem:  # DeepSpeed merges client_state into its own entries, overwriting them
            problem = f"save_ckpt client_state key {reserved[0]!r} is one of DeepSpeed's own entries: rename it"
        # With a problem already, the default tag is never built: an eval engine may have no global_steps.
        tag = str(tag) if tag is not None or problem else f"global_step{self.engine.global_steps}"
        self._raise_on_every_rank(problem or self._tag_problem(tag, "save_ckpt"), ValueError)
        # Step 1, on rank 0; raised on every rank, and until it ends no rank writes: <tag>.saving exists.
        self._raise_on_every_rank(self._start(save_dir, tag, save_latest) if self.rank == 0 else None, RuntimeError)
        record = self._record(metric)  # what the record says besides the files, taken with the state
        files = self._save_own_files(save_dir, tag, client_state, background)  # step 2

        def finish(group):
            """Steps 2 (with background, the writes), 3, 4 and 5, over group (collectives; None: the training's
            process group). Returns None, or what failed, the same on every rank."""
            every_rank = [None] * self.world_size  # each rank's (failed, written, holds)
            dist.all_gather_object(every_rank, files.write_queued(), group=group)
            problem = next((failed for failed, _, _ in every_rank if failed), None)
            if problem is None and self.rank == 0:  # one writer for every shared file
                written = dict(sorted((name, spec) for _, specs, _ in every_rank for name, spec in specs.items()))
                record["files"] = {name: size for name, (size, _) in written.items()}
                record["contents"] = {name: digest for name, (_, digest) in written.items()}  # records_digest
                record["holds"] = {name: slices for _, _, holds in every_rank for name, slices in holds.items()}
                problem = self._commit(save_dir, tag, save_latest, record)
            problem = self._first_of_ranks(problem, group)
            if problem:  # nothing is committed (a record _commit wrote, it removed): every rank gives the space back
                shutil.rmtree(files.staging, ignore_errors=True)  # also where its node has a save_dir of its own
            elif self.rank == 0:  # committed: a failure from here on loses nothing, and the next save finishes the work
                try:
                    self._rename_over(save_dir, tag)
                    self._rotate(save_dir, max_num=max_num, max_bytes=max_mem * 1024**3, keep=tag)
                except Exception as error:  # any error: raised here, it would leave the other ranks waiting
                    self.print(f"warning: {tag} is saved in {save_dir}, but tidying up after it failed: {error!r}")
            # Every rank waits here, on both paths: after a commit no rank reads save_dir while rank 0 still renames
            # in it; after a failure every rank has removed what it could before any raises.
            dist.barrier(group=group)
            return problem

        if background:  # a thread of this rank's own finishes it, over the strategy's own gloo group
            if self.strategy.save_group is None:  # a collective of every rank, on the calling thread
                self.strategy.save_group = dist.new_group(backend="gloo", timeout=self.strategy.timeout)
            self.strategy.pending_save = BackgroundSave(finish, self.strategy.save_group, tag, self.rank)
            try:
                self.strategy.pending_save.start()
            except RuntimeError:  # no thread to be had ("can't start new thread"): it finishes here, a foreground save
                wait_for_save(self.strategy)
        else:
            problem = finish(group=None)
            if problem:
                raise RuntimeError(problem)

    def _metric(self, value, key):
        """(the record's {"key", "value"} for a metric_value, or None; why the save is refused, or None). Any
        number will do (Python, NumPy or a 0-d tensor); NaN and infinity count as no metric."""
        if not (key is None or isinstance(key, str)):  # checked now: the record is written after all files are
            return None, f"save_ckpt metric_key {key!r} must be a name (a string), or None"
        if value is None:
            return None, None
        try:
            number = None if isinstance(value, (bool, str, bytes)) else float(value)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            number = None
        if number is None:
            return None, f"save_ckpt metric_value {value!r} must be a number, or None for no metric"
        if not math.isfinite(number):
            self.print(f"warning: save_ckpt metric_value {value!r} is not finite: saving without a metric")
        return ({"key": key, "value": number} if math.isfinite(number) else None), None

    def _tag_problem(self, tag, caller):
        """Why tag cannot name a checkpoint's folder in the folder of checkpoints, or None."""
        odd = tag != tag.strip() or any(c in tag for c in ("/", os.sep, "\0"))  # latest's reader strips it
        if tag in ("", ".", "..", LATEST) or tag.endswith((STAGING, DELETING)) or odd:
            what = f"{caller} tag {tag!r} must be the name of one folder in the checkpoints' folder, not {LATEST!r}"
            return f"{what} (the file naming the checkpoint to resume), nor ending in {STAGING}, {DELETING} or spaces"
        if len((tag + DELETING).encode()) > 255:  # the longest name a save gives the folder
            return f"{caller} tag {tag!r} is too long: with {DELETING} after it, it must fit in 255 bytes"
        return None

    def _first_of_ranks(self, value, group=None):
        """The first rank's value that is not empty (a problem), as every rank sees it, or None when every rank's
        is empty; over group (None: the training's)."""
        if not dist.is_initialized():  # one process, as save_model and load_model allow
            return value or None
        values = [None] * dist.get_world_size()
        dist.all_gather_object(values, value, group=group)
        return next((v for v in values if v), None)

    def _raise_on_every_rank(self, problem, error_type=RuntimeError) -> None:
        """Raise on every rank if any rank has a problem, so that none waits alone in its next collective (under
        NCCL for the process group's timeout, an hour): a string, raised as error_type, or an exception this rank
        caught, raised again here and as a RuntimeError naming it on the other ranks."""
        caught = problem if isinstance(problem, Exception) else None
        found = self._first_of_ranks(f"{type(caught).__name__} on rank {self.rank}: {caught}" if caught else problem)
        if caught:
            raise caught
        if found:
            raise error_type(found)

    def _start(self, save_dir, tag, save_latest):
        """On rank 0, before any rank writes: clear the table's rows marked *, refuse a tag whose folder is not a
        checkpoint and a save_dir whose newest checkpoint holds another model, and make <tag>.saving. Returns
        None, or why the save cannot start."""
        folder = os.path.join(save_dir, tag)
        try:
            os.makedirs(save_dir, exist_ok=True)
            for name in [n for n in sorted(os.listdir(save_dir)) if n.endswith((STAGING, DELETING))]:
                with contextlib.suppress(OSError):  # what cannot be tidied now (a busy file) waits for a later save
                    if name.endswith(STAGING) and self._deletable(os.path.join(save_dir, name), record=True):
                        self._rename_over(save_dir, name.removesuffix(STAGING))  # committed, but not yet renamed
                    elif self._deletable(os.path.join(save_dir, name)):
                        shutil.rmtree(os.path.join(save_dir, name))
            if os.path.lexists(folder) and not self._deletable(folder, record=True):
                fix = "pass another tag, or move it out of save_dir"
                return f"save_ckpt refused before writing: {folder} is no checkpoint it may replace; {fix}"
            latest = os.path.join(save_dir, LATEST)
            if save_latest and os.path.lexists(latest) and not os.path.isfile(latest):
                return f"save_ckpt refused before writing: {latest} is no file, and the save would write it"
            newest, saved = self._newest(save_dir)
            where, here = f"{save_dir}'s newest checkpoint, {newest},", self._tensor_shapes(self.module)
            mismatch = "tensors" in saved and self._model_mismatch(saved["tensors"], here, where)
            if mismatch:
                fix = "save each model in a save_dir of its own (a save_dir per model: PPO's actor and critic)"
                return f"save_ckpt refused before writing: {mismatch}; {fix}"
            os.makedirs(folder + STAGING)
        except Exception as error:  # any error: raised here, it would leave the other ranks waiting
            return f"save_ckpt could not start in {save_dir} on rank 0: {error!r}; nothing was written"
        return None

    def _deletable(self, path, record=False) -> bool:
        """Whether path is a folder, not a link, holding checkpoint files alone (CHECKPOINT_FILES), and with record
        a record among them: what save_ckpt may delete, or replace."""
        if not os.path.isdir(path) or os.path.islink(path) or record and not os.path.isfile(f"{path}/{DONE_FILE}"):
            return False
        return all(CHECKPOINT_FILES.fullmatch(n) and os.path.isfile(os.path.join(path, n)) for n in os.listdir(path))

    def _checkpoints(self, save_dir) -> dict:
        """{tag: folder} of this file's checkpoints in save_dir (folders holding a record), oldest first in the order
        their records were committed (their sequence; a record that says none, damaged, by its file's time, before
        the others); <tag>.saving stands for <tag>. Not by the files' times alone, which a copy may not keep."""
        found = {}
        for name in sorted(os.listdir(save_dir)) if os.path.isdir(save_dir) else []:  # <tag> before <tag>.saving
            if not name.endswith(DELETING) and is_file(os.path.join(save_dir, name, DONE_FILE)):
                found[name.removesuffix(STAGING)] = name

        def committed(tag):
            folder = os.path.join(save_dir, found[tag])
            sequence = (self._read_record(folder) or {}).get("sequence", 0)
            return sequence, os.path.getmtime(os.path.join(folder, DONE_FILE)), tag

        return {tag: found[tag] for tag in sorted(found, key=committed)}

    def _newest(self, save_dir):
        """(folder, record) of save_dir's newest checkpoint; (None, {}) where there is none, {} for a damaged record."""
        found = list(self._checkpoints(save_dir).values())  # oldest first
        return (found[-1], self._read_record(os.path.join(save_dir, found[-1])) or {}) if found else (None, {})

    def _save_own_files(self, save_dir, tag, client_state, background) -> OwnFiles:
        """This rank's files of the checkpoint, as DeepSpeed's save_checkpoint hands them to the DurableWriter:
        written into <tag>.saving, or with background copied into CPU memory."""
        engine, writer = self.engine, self.engine.checkpoint_engine
        if not isinstance(writer, DurableWriter):  # once per engine
            writer = engine.checkpoint_engine = DurableWriter()
            # The one copy DeepSpeed makes without its writer: at ZeRO 1-3 rank 0 copies its scripts zero_to_fp32.py
            # and zero_to_torch.py into save_dir, after its last write and before its last barrier.
            deepspeeds_copy = engine._copy_recovery_script

            def copy_scripts(path):  # inside a save_ckpt, a failed copy is noted as a failed write is
                if writer.files is None:
                    return deepspeeds_copy(path)
                writer.files.attempt(path + "/zero_to_fp32.py", deepspeeds_copy, path)

            engine._copy_recovery_script = copy_scripts
        # At ZeRO 1-2 a rank's optimizer file holds one flat range of each group: which slice of which parameter,
        # its _hp_mapping says (ZeRO 3's layout follows from the shapes). The record keeps them ("holds"), so that a
        # load opens only the files holding what it needs: ReshapingReader.saved_ranks reads them.
        mapped = [(n, getattr(p, "_hp_mapping", None)) for n, p in self.module.named_parameters()]
        holds = {n: [m.lp_fragment_address.start, m.lp_fragment_address.numel] for n, m in mapped if m}
        staging = os.path.join(save_dir, tag + STAGING)
        files = writer.files = OwnFiles(staging, background, self.rank, writer.buffers, holds)
        # At ZeRO 3 a parameter that trains but that the optimizer does not hold lies in no file DeepSpeed writes
        # (its model states hold a (0,) placeholder): each rank keeps its partition in its model states.
        held = {name for names in engine.param_group_names for name in names}
        params = self.module.named_parameters()
        unheld = {n: p.ds_tensor for n, p in params if hasattr(p, "ds_tensor") and p.requires_grad and n not in held}
        try:
            if not os.path.isdir(staging):  # rank 0 made it: this node does not share save_dir (or sees it late)
                why = "no such folder here: save_dir must be a folder every rank shares"
                files.failed = failed_write(staging, why, self.rank, save_dir)
            files.add(self._get_rng_states(), os.path.join(staging, RNG_FILE.format(rank=self.rank)))
            states = {**client_state, UNHELD: unheld} if unheld else client_state
            engine.save_checkpoint(save_dir, tag=tag + STAGING, client_state=states, save_latest=False)
        finally:
            writer.files = None  # DeepSpeed's own saves from here on are the caller's
        get_accelerator().synchronize()  # the copies into pinned memory have landed before training goes on
        if background:
            writer.buffers = files.copies  # the next background save reuses them: as large as this one's, no more
        return files

    def _get_rng_states(self) -> dict:
        # Plain Python and torch types only, so load_ckpt can read them back with weights_only=True.
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        numpy_state = (kind, keys.tolist(), pos, has_gauss, cached)
        states = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
        states["device_type"] = get_accelerator().device_name()  # a CUDA generator's state means nothing elsewhere
        if states["device_type"] != "cpu":  # on the CPU, torch's generator is the device's
            states["device"] = get_accelerator().get_rng_state()
        return states

    def _commit(self, save_dir, tag, save_latest, record):
        """On rank 0, once every rank's files are durable: write the record (the ranks' files, sizes, contents and at
        ZeRO 1-2 slices already in it; its order of commits added here) into <tag>.saving, then latest. Returns None,
        or what failed (the caller then removes <tag>.saving, so nothing has changed)."""
        record["sequence"] = self._newest(save_dir)[1].get("sequence", 0) + 1  # its files' times may lose the order
        record["crc"] = self._record_crc(record)  # the record's own, so a damaged record is told from a missing one
        try:
            self._write_atomically(os.path.join(save_dir, tag + STAGING, DONE_FILE), json.dumps(record, indent=1))
            fsync(save_dir)  # <tag>.saving's own name, too, survives a power cut
            if save_latest:
                self._write_atomically(os.path.join(save_dir, LATEST), tag)
        except Exception as error:  # any error: raised here, it would leave the other ranks waiting
            with contextlib.suppress(OSError):  # the record first, so that no half is ever complete
                os.remove(os.path.join(save_dir, tag + STAGING, DONE_FILE))
                fsync(os.path.join(save_dir, tag + STAGING))  # gone for good: a power cut must not bring it back
            why = f"save_ckpt could not commit {tag} in {save_dir} on rank 0: {error!r}"
            return f"{why}; the checkpoint before it is unchanged"
        return None

    def _record(self, metric) -> dict:
        """The record load_ckpt reads, but for the files (_commit adds them): the run's shape, the model's tensors
        and the optimizer's groups by name (a ZeRO 0 checkpoint keys Adam's state by position alone), the metric
        ({key, value} or None: rotation ranks by it, and it is durable with the rest)."""
        s = self.strategy
        done = dict(world_size=s.world_size, zero_stage=s.stage, bf16=s.bf16, adam_offload=s.adam_offload)
        groups, tensors = self.engine.param_group_names, self._tensor_shapes(self.module)
        return dict(done, grad_accum_dtype=s.grad_accum_dtype, tensors=tensors, groups=groups, metric=metric)

    def _tensor_shapes(self, module) -> dict:
        """{name: shape} of a module's parameters (their full shape at ZeRO 3) and of the buffers it saves."""
        shapes = {name: list(getattr(p, "ds_shape", p.shape)) for name, p in module.named_parameters()}
        saved = module.state_dict().keys()
        shapes.update((name, list(b.shape)) for name, b in module.named_buffers() if name in saved)
        return shapes

    def _record_crc(self, done) -> int:
        return zlib.crc32(json.dumps(done, sort_keys=True).encode())

    def _write_atomically(self, path: str, text: str) -> None:
        tmp = path + ".tmp"  # one fixed name: one run saves into a save_dir at a time, and the next write replaces it
        with open(tmp, "w") as f:
            f.write(text)
        fsync(tmp)  # on the disk before the rename makes it the file
        os.replace(tmp, path)
        fsync(os.path.dirname(path))  # the rename, too, survives a power cut

    def _rename_over(self, save_dir, tag) -> None:
        """Make the committed <tag>.saving <tag>: an older <tag> is renamed out of the way first and removed last,
        so the new one takes its name at once (on Lustre removing a folder can take minutes). Until then
        <tag>.saving is the checkpoint <tag>, the table's second row."""
        folder = os.path.join(save_dir, tag)
        if os.path.lexists(folder):
            if not self._deletable(folder):
                raise OSError(f"{folder} holds what no checkpoint holds: it stays, as {tag}{STAGING}")
            os.rename(folder, folder + DELETING)
        os.rename(folder + STAGING, folder)
        fsync(save_dir)
        if os.path.lexists(folder + DELETING):
            shutil.rmtree(folder + DELETING)

    def _delete(self, save_dir, name) -> None:
        """Delete a checkpoint: renamed to <name>.deleting first (and the rename made durable), so a delete cut
        short leaves a working folder that the next save removes, never a checkpoint with files missing."""
        folder = os.path.join(save_dir, name)
        os.rename(folder, folder + DELETING)
        fsync(save_dir)
        shutil.rmtree(folder + DELETING)

    def _rotate(self, save_dir, max_num, max_bytes, keep):
        """After a commit: delete every best checkpoint but the newest, then the checkpoints over max_num (which
        best ones do not count) or max_bytes (which they do), in the order save_ckpt's docstring gives, never keep
        or latest's."""
        protected = {keep, self._read_latest(save_dir)}
        # This file's checkpoints, oldest first. A link (a run branched from another run's checkpoint) stays:
        # deleting through it would delete the other run's checkpoint. So does a folder you put other files in.
        ours = [tag for tag in self._checkpoints(save_dir) if self._deletable(os.path.join(save_dir, tag))]
        best = [tag for tag in ours if tag.startswith("best")]
        # Only the newest best stays: a crash between a best's commit and this rotation can leave two.
        for tag in [t for t in best[:-1] if t not in protected]:
            self._delete(save_dir, tag)
            ours.remove(tag)
        # Each checkpoint's bytes: the files in its folder (a checkpoint's folder holds files alone: _deletable).
        sizes = {tag: sum(entry.stat().st_size for entry in os.scandir(os.path.join(save_dir, tag))) for tag in ours}
        count, total = len([tag for tag in ours if not tag.startswith("best")]), sum(sizes.values())
        metrics = {tag: self._saved_metric(os.path.join(save_dir, tag)) for tag in ours}
        # No metric first, then the lowest, then the oldest (ours is oldest first, and sorted() keeps that order).
        order = sorted(ours, key=lambda tag: (metrics[tag] is not None, metrics[tag] or 0.0))
        for tag in [t for t in order if t not in protected and not t.startswith("best")]:
            if count <= max_num and total <= max_bytes:
                break
            self._delete(save_dir, tag)
            count, total = count - 1, total - sizes[tag]

    def _read_latest(self, save_dir: str):
        """The tag latest names, or None where there is no latest file or it cannot be read (a folder, binary)."""
        try:
            with open(os.path.join(save_dir, LATEST)) as f:
                return f.read().strip() or None
        except (OSError, UnicodeDecodeError):
            return None

    def _saved_metric(self, folder):
        """The metric_value a checkpoint was saved with, from its record, or None: a damaged record counts as none,
        so such a checkpoint goes first."""
        value = ((self._read_record(folder) or {}).get("metric") or {}).get("value")
        return value if _is_number(value) and math.isfinite(value) else None

    # ---------------------------------------------------------------------------------------------------------
    # Loading

    def load(self, load_dir, tag, *, strict, load_optimizer_states, load_lr_scheduler_states, load_module_only):
        """Load a checkpoint into a prepared engine and restore this rank's random generators; returns (load_path,
        client_state), or (None, {}) when load_dir holds no checkpoint at all (a run that starts afresh). All ranks
        must call it. In order:
        1. Choose. A tag names its checkpoint (<tag>.saving where that holds a record: the newer); a tag that is not
           one folder's name is refused. With tag None: the one latest names, saying so where another checkpoint is
           newer (saved with save_latest=False, or latest set back by hand: latest wins); without latest the newest
           checkpoint, also saying so. A candidate that fails its check gives way to the newest that passes, saying
           why; a named tag that fails raises on every rank. Rank 0 lists load_dir and reads the records, for all;
           each rank checks its share of a candidate's files (sizes, contents, the CRCs of their records), and all
           agree on one verdict. A read that fails (EIO) is no damage: it raises on every rank. Where rank 0 sees
           no checkpoint, every rank must see none.
        2. Check the model: another model (names or shapes) is refused while strict (load_module_strict) holds;
           without it, the tensors that match by name and shape load, the rest keep their values, and rank 0 lists
           both.
        3. Load, in this run's shape, whatever the saving run's (ReshapingReader, at the end of this file): each
           rank reads the slices it will hold from the files that hold them, each file checked first by its size
           and its records (a rank's view of the folder may be stale). load_module_only=True, and an eval engine,
           load the weights alone (fp32 masters too, which the next step starts from). Buffers and client_state
           are what the model states hold: at ZeRO 3 each rank's own (a rank the saving run did not have gets rank
           0's), below it rank 0's, the one DeepSpeed writes. The returned client_state is a copy: no tensor of it
           keeps the file open. The scheduler and the counters as DeepSpeed's own load restores them; not the
           checkpoint's gradient_clipping, which DeepSpeed's load puts back: this run's max_norm holds.
        4. Restore the random generators (also with load_module_only).
        A failure on any rank (a file that cannot be read) raises on every rank, naming the rank and the file.

        Load only checkpoints you trust: DeepSpeed's files are pickles (read with weights_only=False), so a crafted
        checkpoint runs code as it loads. Exchange weights with save_model and load_model instead."""
        engine = self.engine
        problem = None if tag is None else self._tag_problem(str(tag), "load_ckpt")  # a path would read two folders
        if problem:
            raise ValueError(f"{problem}; tag=None loads the checkpoint {LATEST!r} names")
        folder, done = self._choose_checkpoint(load_dir, tag)
        if folder is None:
            self.print(f"{load_dir} holds no checkpoint: nothing loaded, the run starts afresh")
            return None, {}
        ckpt_dir = os.path.join(load_dir, folder)
        here = self._tensor_shapes(engine.module)
        mismatch = self._model_mismatch(done["tensors"], here, f"checkpoint {ckpt_dir}")
        if mismatch and strict:  # the same record and model on every rank: each raises alike
            raise ValueError(mismatch)
        loadable = {name for name, shape in here.items() if done["tensors"].get(name) == shape}
        trains = training_optimizer(engine) is not None and not load_module_only
        reader, rng_states, error = ReshapingReader(engine, ckpt_dir, done), None, None
        try:
            states = reader.load(loadable, load_optimizer_states and trains)
            if load_lr_scheduler_states and trains:
                reader.check_groups()
                if engine.lr_scheduler is not None:
                    engine.lr_scheduler.load_state_dict(states["lr_scheduler"])
            # The counters, as DeepSpeed's own load restores them.
            if not load_module_only:
                engine.global_steps = states["global_steps"]
                engine.global_samples = states.get("global_samples", engine.global_steps * engine.train_batch_size())
                engine.skipped_steps = states["skipped_steps"]
            # What the caller passed, copied out of the memory-mapped file: a tensor of it kept (as OpenRLHF's fit()
            # keeps it) would keep the whole file open, and its space taken on disk after rotation deletes it.
            client_state = copy.deepcopy({key: value for key, value in states.items() if key not in RESERVED_KEYS})
            if self.rank < done["world_size"]:  # else a rank the saving run did not have
                rng_states = load_file(os.path.join(ckpt_dir, RNG_FILE.format(rank=self.rank)), done, weights_only=True)
        except Exception as caught:  # name it, and let no rank go on alone
            error = f"checkpoint {ckpt_dir} does not load on rank {self.rank} ({socket.gethostname()}): {caught}"
        self._raise_on_every_rank(error, RuntimeError)
        reader.finish()  # collective
        self._raise_on_every_rank(reader.verify(loadable, load_optimizer_states and trains), RuntimeError)
        if mismatch:
            kept, unused = sorted(set(here) - loadable), sorted(set(done["tensors"]) - loadable)
            self.print(f"loaded {ckpt_dir} by name and shape; kept as they were: {kept}; not loaded: {unused}")
        if rng_states is not None:
            self._set_rng_states(rng_states)
        else:  # a seed of its own, the same on every rerun
            self.strategy.set_seed(self.strategy.seed + 1000 * engine.global_steps + self.rank)
        return os.path.join(ckpt_dir, model_states_file(done["zero_stage"])), client_state

    def _choose_checkpoint(self, load_dir, tag):
        """(folder, record) of the checkpoint to load, checked, or (None, None) where tag is None and load_dir
        holds no checkpoint: load's step 1. Rank 0 alone lists load_dir and reads latest and the records, and hands
        what it found to every rank: listings that differed between nodes (a network filesystem's cache) would make
        the ranks choose differently and wait for each other in different collectives. Then every rank checks its
        share of each candidate's files in turn, and the ranks agree on each verdict."""
        found = [self._candidates(load_dir, tag) if self.rank == 0 else None]  # a list: the broadcast fills it
        dist.broadcast_object_list(found, src=0)
        refusal, candidates, note = found[0]
        if refusal is not None:  # load_dir cannot be loaded from at all: alike on every rank
            raise refusal
        failed = []  # why each candidate so far cannot load: an exception, raised as it is where none can
        for name, folder, done, problem in candidates:  # problem: rank 0's, before any file is checked
            problem = problem or self._first_of_ranks(self._damaged_share(os.path.join(load_dir, folder), done))
            if type(problem) is OSError:  # a read that failed (EIO, ESTALE) is no damage: never a fall back for it
                raise RuntimeError(f"load_ckpt: {problem}")
            if problem is None:
                if failed:
                    note = f"{failed[0]}: resuming from {name} instead, the newest checkpoint that passes"
                if note:
                    self.print(note)
                return folder, done
            failed.append(problem)
        if failed:
            more = f"; and {len(failed) - 1} older ones fail too" if len(failed) > 1 else ""
            raise type(failed[0])(f"{failed[0]}{more}")
        try:  # rank 0 sees no checkpoint: a rank that sees one would start afresh, alone
            seen = ", ".join(self._checkpoints(load_dir))
        except OSError as error:  # it cannot list load_dir: say why, to every rank
            seen = repr(error)
        fix = "load_dir must be a folder every rank sees alike (a shared filesystem whose cache has settled)"
        problem = f"load_ckpt: rank 0 sees no checkpoint in {load_dir}, but rank {self.rank} sees {seen}: {fix}"
        self._raise_on_every_rank(problem if seen else None, RuntimeError)
        return None, None

    def _candidates(self, load_dir, tag):
        """On rank 0: (None, the checkpoints to try, in order, each (tag, folder, record, why it cannot load: an
        exception, or None), what to say if the first loads), or (why nothing in load_dir can load, [], None). It
        never raises: an error on rank 0 alone would leave the others waiting for its answer."""
        try:
            found = self._checkpoints(load_dir)  # {tag: folder}, oldest first
            latest, newest = self._read_latest(load_dir), (list(found) or [None])[-1]
            names = [str(tag)] if tag is not None else ([latest] if latest else [])
            if tag is None:  # latest's checkpoint first, then the others, newest first
                names += [name for name in reversed(found) if name != latest]
            if not names and self._holds_states(load_dir):
                # A checkpoint's own folder given as load_dir (a plausible --ckpt_path) must not start the run afresh.
                parent, name = os.path.split(os.path.normpath(load_dir))
                why = f"load_ckpt load_dir {load_dir} is one checkpoint, not the folder of checkpoints"
                return ValueError(f"{why}: pass load_dir={parent!r} (and tag={name!r} to load this one)"), [], None
            listing = sorted(os.listdir(load_dir)) if not names and os.path.isdir(load_dir) else []
            listing = [name for name in listing if not name.endswith((STAGING, DELETING))]  # no checkpoints
            plain = [name for name in listing if self._holds_states(os.path.join(load_dir, name))]
            if plain:  # and none of this file's: never a silent fresh start
                why = f"load_ckpt found plain DeepSpeed checkpoints in {load_dir} ({', '.join(plain)}), none of its own"
                return ValueError(f"{why}: {PLAIN_FIX}"), [], None
            note = None
            if tag is None and latest is None and names:
                note = f"{load_dir} has no {LATEST!r} file: resuming from its newest checkpoint, {names[0]}"
            elif tag is None and latest in found and newest != latest:
                why = "saved with save_latest=False, cut short before latest was written, or latest set back"
                note = f"{load_dir}: resuming {latest}, as latest says, though {newest} is newer ({why}); "
                note += f"tag={newest!r} resumes that one"
            folders = [(name, found.get(name, name)) for name in names]
            return None, [(n, f, *self._read_candidate(os.path.join(load_dir, f))) for n, f in folders], note
        except Exception as error:  # a listing or a file that cannot be read
            return RuntimeError(f"load_ckpt cannot read {load_dir} on rank 0: {error!r}"), [], None

    def _holds_states(self, folder) -> bool:
        """Whether folder holds DeepSpeed's model states: a checkpoint, with a record or without (a plain one)."""
        return any(os.path.isfile(os.path.join(folder, model_states_file(stage))) for stage in (0, 3))

    def _read_candidate(self, path):
        """On rank 0: (record, None) of the checkpoint at path, or (None, why it cannot load: an exception)."""
        if is_file(os.path.join(path, DONE_FILE)):
            done = self._read_record(path)
            if done is None:  # it fails its own CRC
                return None, RuntimeError(f"checkpoint {path} does not load: its {DONE_FILE} is damaged")
            return done, None
        if self._holds_states(path):
            why = "a plain DeepSpeed checkpoint, or one whose record was lost"
            return None, ValueError(f"checkpoint {path} has no {DONE_FILE} ({why}): {PLAIN_FIX}")
        what = f"checkpoint {path} is missing or incomplete as {socket.gethostname()} sees it (no {DONE_FILE})"
        why = "the run stopped while saving it, or this node does not share the filesystem it was saved on"
        return None, FileNotFoundError(f"{what}: {why}; load an earlier tag, or tag=None")

    def _read_record(self, path):
        """A checkpoint's record, or None if it is damaged (it carries its own CRC). A read that fails raises."""
        try:
            with open(os.path.join(path, DONE_FILE)) as f:
                done = json.load(f)
            crc = done.pop("crc")
        except (ValueError, KeyError, AttributeError, TypeError):  # not JSON, not a dict, no crc
            return None
        return done if crc == self._record_crc(done) else None

    def _damaged_share(self, path, done):
        """What is wrong with this rank's share of the checkpoint's files (a RuntimeError; an OSError where one could
        not be read), or None. Rank r of this run checks the files saving rank r (and r + world_size, ...) wrote, the
        model states shared by all with rank 0's: each at its saved size, holding the records its record names, every
        record's CRC right. In the same run shape these are the files each rank reads; whatever file it reads, a rank
        checks its size and records (load_file). The record, only rank 0 reads."""
        try:
            for name in [name for name in done["files"] if saving_rank(name) % self.world_size == self.rank]:
                problem = saved_file_damage(path, name, done, world_size=1)
                if problem:
                    return RuntimeError(f"checkpoint {path} does not load: {problem}")
        except OSError as error:
            return OSError(f"reading {path} failed on rank {self.rank} ({socket.gethostname()}): {error!r}")
        return None

    def _model_mismatch(self, saved, here, where):
        """Why the saved tensors ({name: shape}) are another model's than here (the first differing names and
        shapes), else None."""
        differing = [name for name in sorted(set(saved) | set(here)) if saved.get(name) != here.get(name)]
        if not differing:
            return None
        shown = [f"{n}: saved {saved.get(n, 'absent')}, here {here.get(n, 'absent')}" for n in differing[:3]]
        return f"{where} holds another model: {len(differing)} tensors differ ({', '.join(shown)})"

    def _set_rng_states(self, states: dict) -> None:
        random.setstate(states["python"])
        torch.set_rng_state(states["torch"])
        numpy.random.set_state(states["numpy"])  # numpy takes the generator's keys as a list too
        here, saved_on = get_accelerator().device_name(), states["device_type"]
        if saved_on != here:  # a CUDA state on a CPU, or none for this GPU: a seed of its own, as for a new rank
            if here != "cpu":
                get_accelerator().manual_seed(self.strategy.seed + 1000 * self.engine.global_steps + self.rank)
            self.print(f"the checkpoint's {saved_on} generator cannot go on on {here}: {here}'s is seeded anew")
        elif here != "cpu":  # on the CPU, torch's generator is the device's
            get_accelerator().set_rng_state(states["device"])

    # ---------------------------------------------------------------------------------------------------------
    # Model weights: save_model writes the full weights for use outside training, load_model reads them back

    def save_model(self, tokenizer, output_dir, **kwargs) -> None:
        """Write the full weights (gathered at ZeRO 3) to output_dir: pytorch_model.bin, or through the model's
        save_pretrained(output_dir, state_dict=...) when it has one, with a tokenizer's save_pretrained beside it.
        The keys are module.state_dict()'s and tied tensors stay tied. All ranks must call it; a failure on rank 0
        raises on every rank. With load_model, the safe way to exchange weights."""
        caught = None
        try:
            state_dict = self._full_state_dict()  # collective at ZeRO 3
            if self.rank == 0:
                self._write_weights(state_dict, tokenizer, output_dir, kwargs)
        except Exception as error:  # rank 0 alone copies and writes: its failure must reach the others
            caught = error
        self._raise_on_every_rank(caught)

    def _write_weights(self, state_dict, tokenizer, output_dir, kwargs) -> None:
        """Rank 0's part of save_model. The files are written into a folder inside output_dir first. Then every
        file of an earlier save that this one writes too goes, and every earlier weight file (a loader could read
        them instead of the new ones, or with them: a model.safetensors beside a new pytorch_model.bin), before the
        new files are renamed into place: cut short, output_dir never holds a file of each save. The new files are
        durable before any earlier one goes; cut short between the removal and the renames, output_dir holds no
        weights, and the new ones lie complete in output_dir/.saving-<random>, to move up by hand (the next
        save_model removes that folder). Its other files stay as they are: a file named as weights are
        (WEIGHT_FILES) is taken for an earlier save's."""
        os.makedirs(output_dir, exist_ok=True)
        for name in [n for n in os.listdir(output_dir) if n.startswith(".saving-")]:  # a save_model killed earlier
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
        staging = tempfile.mkdtemp(prefix=".saving-", dir=output_dir)  # the same filesystem, so renames are atomic
        try:
            if hasattr(self.module, "save_pretrained"):
                self.module.save_pretrained(staging, state_dict=state_dict, **kwargs)
            else:
                torch.save(state_dict, os.path.join(staging, "pytorch_model.bin"))
            if hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(staging)
            new = sorted(os.listdir(staging), key=lambda name: name.endswith(".index.json"))  # indexes last
            for name in new:
                fsync(os.path.join(staging, name))  # on the disk before any earlier file goes
            fsync(staging)
            for name in [n for n in os.listdir(output_dir) if n in new or WEIGHT_FILES.fullmatch(n)]:
                os.remove(os.path.join(output_dir, name))
            fsync(output_dir)  # gone for good before any new file takes a name
            for name in new:
                os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
            fsync(output_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _full_state_dict(self) -> dict:
        """module.state_dict() as full CPU tensors on rank 0 ({} elsewhere): every key, also of a module under two
        names, and a tensor behind several keys copied once, so ties survive. ZeRO 3 gathers one submodule at a
        time, read-only (modifier_rank=None): nothing is written back to the shards, as DeepSpeed's own private
        gatherer, _zero3_consolidated_16bit_state_dict, does."""
        copies, caught = {}, None  # id of a parameter or buffer -> its full copy on CPU; rank 0's failure
        for submodule in self.module.modules():
            params = list(submodule.parameters(recurse=False))
            # At ZeRO 3 a submodule's full weights exist only inside the gather; below ZeRO 3 it does nothing.
            # A copy (one, from a GPU): at ZeRO 1 and 2 parameters are views into one flat buffer that torch.save
            # would write whole.
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                try:
                    if self.rank == 0 and caught is None:
                        copies.update({id(p): p.detach().to("cpu", copy=True) for p in params if id(p) not in copies})
                except Exception as error:  # out of host memory, say: raised once every rank has ended its gathers
                    caught = error
        if caught is not None:
            raise caught
        if not self.rank == 0:
            return {}
        tensors = self.module.state_dict(keep_vars=True)  # {key: the parameter or buffer itself}
        for value in tensors.values():
            if id(value) not in copies:  # a buffer: the loop above copied every parameter
                copies[id(value)] = value.detach().to("cpu", copy=True)  # a copy, not the live buffer
        return {key: copies[id(value)] for key, value in tensors.items()}

    def load_model(self, path, map_location, strict, key_replace_fn) -> None:
        """Load a state dict file into model (a module or an engine, which then trains on from it), reading tensors
        only (weights_only=True): a file carrying other objects is refused and its code never runs. The file's CRCs
        are checked first (at ZeRO 3 the work spread over the ranks). A file none of whose keys the model has is
        refused even with strict=False; else rank 0 reports missing and extra keys. At ZeRO 3 each rank reads only
        its shards."""
        # Below ZeRO 3 this rank reads the whole file and checks it alone; at ZeRO 3, where every rank must call
        # this and reads only its shards, the ranks share the check.
        zero3 = any(hasattr(p, "ds_id") for p in self.module.parameters())  # partitioned
        rank, world_size = (dist.get_rank(), dist.get_world_size()) if zero3 else (0, 1)
        zipped = zipfile.is_zipfile(path)  # torch.save's format, a CRC for each tensor; other formats have none
        problem = f"{path} is missing" if not os.path.isfile(path) else None
        try:  # a read that fails is refused as damage is, on every rank: raised here alone, the others would wait
            problem = problem or (zip_damage(path, None, rank, world_size) if zipped else None)
        except OSError as error:
            problem = f"{path} cannot be read on rank {rank}: {error!r}"
        every_rank = isinstance(self.engine, deepspeed.DeepSpeedEngine) or zero3  # every rank calls it
        problem = self._first_of_ranks(problem) if every_rank else problem
        if problem:
            raise ValueError(f"refusing to load: {problem}")
        caught = None
        try:  # memory-mapped where the format allows: a tensor is read only where it is used
            state_dict = torch.load(path, map_location=map_location, weights_only=True, mmap=zipped)
            if key_replace_fn is not None:
                state_dict = key_replace_fn(state_dict)
            self._load_state_dict(state_dict, strict, source=path)
        except pickle.UnpicklingError as error:
            why = "it holds Python objects besides tensors, and unpickling them could run code: load a state dict"
            caught = ValueError(f"refusing to load {path}: {why} (save_model writes one).\n{error}")
        except Exception as error:
            caught = error
        if every_rank:
            self._raise_on_every_rank(caught)
        elif caught:
            raise caught
        if zero3:
            gather_persistent(self.module)  # collective

    def _load_state_dict(self, state_dict, strict, source) -> None:
        """Write state_dict into model's tensors, at ZeRO 3 each rank only its own partition (there
        module.load_state_dict would meet the (0,) placeholders ZeRO 3 leaves between uses, not the weights; the
        caller then gathers the small parameters every rank keeps whole), then into a training engine's fp32
        master copy, which the next step would otherwise write back."""
        # {key: the parameter or buffer itself}, a tied tensor under each of its names; at ZeRO 3 too.
        tensors = self.module.state_dict(keep_vars=True)
        if not set(state_dict) & set(tensors):
            keys = f"the file has {sorted(state_dict)[:3]}..., the model {sorted(tensors)[:3]}... (key_replace_fn?)"
            raise ValueError(f"none of the {len(state_dict)} keys in {source} is a key of the model: {keys}")
        missing, unexpected = [k for k in tensors if k not in state_dict], [k for k in state_dict if k not in tensors]
        if strict and (missing or unexpected):
            raise RuntimeError(f"{source}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
        for key, value in state_dict.items():
            if key in tensors:  # an unexpected key has nowhere to go
                shape = tuple(getattr(tensors[key], "ds_shape", tensors[key].shape))
                if tuple(value.shape) != shape:
                    raise RuntimeError(f"{source}: {key} has shape {tuple(value.shape)}, the model's {shape}")
                write_tensor(tensors[key], [Piece(0, value.reshape(-1))])  # one piece: all of it, from element 0
        if missing or unexpected:
            counts = f"{len(missing)} missing keys {missing[:5]} and {len(unexpected)} unexpected keys {unexpected[:5]}"
            self.print(f"loaded {source} with {counts}")
        optimizer = getattr(self.engine, "optimizer", None)
        if hasattr(optimizer, "refresh_fp32_params"):  # ZeRO 1-3, and bf16 at stage 0
            optimizer.refresh_fp32_params()


# The reader: DeepSpeed's private save formats, what a maintainer needs.
#
# A worked example first: one parameter of 131,584 elements saved by 4 ranks at ZeRO 3, resumed by 3 ranks at ZeRO 2.
# ZeRO 3 cut it into 4 slices of 32,896 elements (numel / 4, rounded up): saving rank r's optimizer file holds
# elements [32,896 r, 32,896 (r + 1)) of it inside its flat fp32 partition, after the slices of the parameters before
# it, and Adam's moments at the same offsets. Reading those files gives 4 Pieces per key ("value", the fp32 master;
# "exp_avg"; "exp_avg_sq"), starting at elements 0, 32,896, 65,792 and 98,688 of the flattened parameter. ZeRO 2
# lays a group's parameters end to end and gives each rank one range of that line; say rank 1's range starts 20,000
# elements into this parameter: rank 1's Fragment of it is (name, start 20,000, offset 0 in its master, length
# 111,584), and read_elements copies elements [20,000, 32,896) of the first piece and all of the other three into
# the master, and likewise into Adam's moments. Last, update_lp_params() (every rank) gathers the ranges into each
# rank's 16-bit weights. Which files rank 1 opens follows from the shapes in the record: the saving ranks whose
# slices overlap [20,000, 131,584) of this parameter, here all 4 (saved_ranks).
#
# In general: load_ckpt reads DeepSpeed's files itself, in every run shape, the saving run's too: one path, which
# writes the fp32 masters whatever the options, fails on every rank alike (no collective runs until all have read),
# and scales. Each rank opens only the saved files holding a slice of what it will hold (the record says which slices
# each ZeRO 1-2 optimizer file holds; ZeRO 3's follow from the shapes): in the same shape its own; resuming at ZeRO 3,
# the files whose slices overlap its partition; at ZeRO 1-2, those overlapping its flat range; at ZeRO 0, where every
# rank keeps everything, all. They are memory-mapped, so only those slices are read from disk. The saved side is a
# dict of Pieces, pieces[name, key]: the saved slices of one flattened tensor, key "value" (the fp32 master weight of a
# trained parameter, a frozen parameter or a buffer) or one of the optimizer's state keys. The loading side is this
# rank's Fragments: which elements of which parameter each of its optimizer's fp32 masters holds. read_elements fills a
# fragment from the pieces that overlap it; write_tensor writes 16-bit weights, frozen parameters and buffers.
#
# What it reads and writes, and the private DeepSpeed 0.19.8 names it relies on (the oldest release that
# requirements.txt allows; the reshape tests fail if a later release renames them):
#
#   saved at           file (per rank where R shows)                    entries read
#   ZeRO 0             mp_rank_00_model_states.pt                       module; optimizer: torch's state_dict, or at
#                                                                       bf16 optimizer_state_dict and fp32_groups
#   ZeRO 1, 2          *zero_pp_rank_R_mp_rank_00_optim_states.pt       base_optimizer_state,
#                                                                       single_partition_of_fp32_groups,
#                                                                       param_slice_mappings
#                      mp_rank_00_model_states.pt                       module (frozen parameters, buffers)
#   ZeRO 3             the same, and zero_pp_rank_R_..._model_states.pt optimizer_state_dict, fp32_flat_groups;
#                                                                       param_shapes, frozen_param_fragments,
#                                                                       module (buffers), this file's UNHELD
#
#   written into (engine.optimizer)  when DeepSpeed picks it                    16-bit groups, fp32 masters
#   torch's optimizer                ZeRO 0, fp32                               its param_groups' parameters
#   FP16_UnfusedOptimizer            ZeRO 0, bf16                               fp16_groups, fp32_groups
#   DeepSpeedZeroOptimizer           ZeRO 1 and 2, but for the next row         bit16_groups,
#                                                                               single_partition_of_fp32_groups
#   BF16_Optimizer                   ZeRO 1, bf16, grad_accum_dtype fp32,       bf16_groups,
#                                    no adam_offload                            fp32_groups_flat_partition
#   DeepSpeedZeroOptimizer_Stage3    ZeRO 3                                     fp16_groups,
#                                                                               fp32_partitioned_groups_flat
#   none (an eval engine)            prepare(model)                             the weights alone
#
# The optimizer inside (the base) is torch's Adam or AdamW, whose state is exp_avg, exp_avg_sq (and with amsgrad
# max_exp_avg_sq), or DeepSpeedCPUAdam (exp_avg, exp_avg_sq); both count a step. Anything else is refused by name
# before any state changes.

# The wrappers by class name: (the attribute holding each group's 16-bit parameters, the one holding its masters).
WRAPPERS = {
    "FP16_UnfusedOptimizer": ("fp16_groups", "fp32_groups"),
    "DeepSpeedZeroOptimizer": ("bit16_groups", "single_partition_of_fp32_groups"),
    "BF16_Optimizer": ("bf16_groups", "fp32_groups_flat_partition"),
    "DeepSpeedZeroOptimizer_Stage3": ("fp16_groups", "fp32_partitioned_groups_flat"),
}
FLAT_RANGES = ("DeepSpeedZeroOptimizer", "BF16_Optimizer")  # one flat range per group, cut by each rank's share
MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's state besides its step: the running mean of gradients and of squares


# A Piece: elements [start, start + len(values)) of a flattened saved tensor (values is 1-D).
Piece = NamedTuple("Piece", [("start", int), ("values", torch.Tensor)])
# A Fragment: elements [start, start + length) of parameter `name`, flattened, which lie at [offset, offset + length)
# of a flat tensor: a saved fp32 partition, or a master this rank's optimizer steps.
Fragment = NamedTuple("Fragment", [("name", str), ("start", int), ("offset", int), ("length", int)])


class ReshapingReader:
    """Writes a checkpoint saved in any run shape into an engine (see the section's header): the fp32 masters and,
    with optimizer_states, the optimizer's state, step and each group's hyperparameters; frozen parameters and
    buffers; the 16-bit weights, except where finish() must follow on every rank."""

    def __init__(self, engine, ckpt_dir: str, done: dict):
        self.engine, self.ckpt_dir, self.done, self.optimizer = engine, ckpt_dir, done, training_optimizer(engine)
        self.kind = type(self.optimizer).__name__
        self.names = {id(p): name for name, p in engine.module.named_parameters()}  # each parameter's name
        self.opened = {}  # {file name: what read_file read}
        # What read_saved, just below, reads:
        self.pieces = {}  # {(name, key): [Piece]}, key "value" or a state key (the section's header)
        self.groups = []  # the saved optimizer groups' hyperparameters
        self.steps, self.saved_keys = [], set()  # each saved fragment's step count; the state keys besides the step
        self.step = 0  # the step count to resume from: the largest of steps
        self.model_states = {}  # the model states file, with the counters, the scheduler and client_state

    def read_saved(self, wanted) -> None:
        """Read the checkpoint's pieces and optimizer state that hold wanted ([(name, first element, length)]), into
        the attributes __init__ names: from the model states (at ZeRO 3 this rank's own, or rank 0's where the saving
        run had no rank of its number), then by the reader of the saving run's ZeRO stage from the files of the saving
        ranks that hold them."""
        stage, tensors, rank = self.done["zero_stage"], self.done["tensors"], dist.get_rank()
        own = rank if rank < self.done["world_size"] else 0
        model_states = self.model_states = self.read_file(model_states_file(stage, own))
        # A parameter no optimizer stepped (frozen when saved, though a user's optimizer may list it) lies whole in
        # the module, at ZeRO 3 in each rank's frozen fragments; buffers lie whole in the module at every stage.
        stepped = {name for shapes in model_states.get("param_shapes") or [] for name in shapes}
        buffers = set(model_states.get("buffer_names") or [])
        if stage == 0:
            self.groups = self.read_zero0(model_states)
        elif stage < 3:
            self.groups = self.read_zero12(self.saved_ranks(wanted))
        else:  # buffers: whole in this rank's model states, no reason to open another rank's files
            ranks = self.saved_ranks([w for w in wanted if w[0] not in buffers])
            self.groups = self.read_zero3(model_states["param_shapes"], set(tensors) - stepped - buffers, ranks)
        for name in set(tensors) - stepped:
            if (name, "value") not in self.pieces and (stage < 3 or name in buffers):
                self.add(name, "value", 0, model_states["module"][name])
        self.step = int(max(self.steps, default=0))

    @torch.no_grad()
    def load(self, loadable: set, optimizer_states: bool) -> dict:
        """Write the tensors named in loadable (the rest keep their values), and with optimizer_states (which needs
        an optimizer) the optimizer's state; returns the saved model states. Every check that can refuse comes
        first, so a refusal leaves the engine as it was (but for read_elements finding fewer elements than the
        record says a file holds, which no undamaged checkpoint gives)."""
        fragments = list(self.owned_fragments()) if self.optimizer is not None else []
        fragments = [(fragment, master) for fragment, master in fragments if fragment.name in loadable]
        # The 16-bit weights of trained parameters come from their masters: written here where this rank holds
        # the whole master (or its ZeRO 3 partition); where a flat range cuts them, finish() gathers them.
        cut = self.trained_names() if self.kind in FLAT_RANGES else set()
        module = self.engine.module
        tensors = [(n, t) for n, t in [*module.named_parameters(), *module.named_buffers()] if n in loadable - cut]
        # What this rank writes, as (name, first element, length): the saved files to open are those holding it.
        wanted = [(f.name, f.start, f.length) for f, _ in fragments]
        wanted += [(name, *partition_span(tensor)) for name, tensor in tensors]
        self.read_saved(wanted)
        base = getattr(self.optimizer, "optimizer", self.optimizer)  # the wrappers hold torch's or DeepSpeed's Adam
        if optimizer_states:
            keys = self.state_keys(base)
            self.check_groups()
            # Checked: from here on only writes. The groups' hyperparameters, not the switches of how a step is
            # computed; DeepSpeedCPUAdam's bias corrections (only the optimizer's groups and the step count needed).
            switches = {"params", "foreach", "fused", "capturable", "differentiable"}
            for group, saved_group in zip(base.param_groups, self.groups):
                group.update({key: value for key, value in saved_group.items() if key not in switches})
            if isinstance(base, deepspeed.ops.adam.DeepSpeedCPUAdam):
                replay_bias_corrections(base, self.step)
            # torch's optimizers count steps in a 0-d float tensor (on the weights' device when fused or
            # capturable), DeepSpeedCPUAdam in an int.
            on_device = any(group.get("fused") or group.get("capturable") for group in base.param_groups)
            is_torch = type(base).__module__.startswith("torch.")
        for (name, start, offset, length), master in fragments:
            values = read_elements(self.pieces.get((name, "value"), []), start, length)  # none: padding alone
            master.view(-1)[offset : offset + length] = values
            if optimizer_states:
                state = base.state[master]  # torch's optimizers make an entry for any key asked for
                for key in keys:
                    # Not setdefault, whose default (a tensor the size of the master) would be built on every call.
                    if key not in state:
                        state[key] = torch.zeros_like(master)
                    values = read_elements(self.pieces.get((name, key), []), start, length, required=False)
                    state[key].view(-1)[offset : offset + length] = values
                device = master.device if on_device else "cpu"
                state["step"] = torch.tensor(float(self.step), device=device) if is_torch else self.step
        for name, tensor in tensors:
            write_tensor(tensor, self.pieces.get((name, "value"), []))
        return self.model_states

    def finish(self) -> None:
        """After every rank loaded (collective): at ZeRO 1-2 each rank's masters into every rank's 16-bit weights;
        at ZeRO 3 the small parameters every rank keeps whole, gathered from the partitions just written."""
        if self.kind in FLAT_RANGES:
            self.optimizer.update_lp_params()
        gather_persistent(self.engine.module)

    def verify(self, loadable: set, optimizer_states: bool):
        """What DeepSpeed's public getters read back otherwise than the checkpoint holds, or None (collective). The
        reader writes into DeepSpeed's private layouts, which a newer DeepSpeed may change: each group's first and
        last parameter (those of them that train and were loaded), its fp32 master and (with optimizer_states) Adam's
        moments, are read back through safe_get_full_fp32_param and safe_get_full_optimizer_state (at ZeRO 0 torch's
        optimizer has no getter) and compared with every slice this rank read of them."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        if self.optimizer is None:  # an eval engine: its weights alone, no masters
            return None
        # At ZeRO 1-2 DeepSpeed links its getters to Adam's state once, after the first step's first group (the
        # other groups' state does not exist yet): linked anew here, to all of the state just written.
        link = getattr(self.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if optimizer_states and link is not None:
            self.optimizer._hp_optimizer_states_linked = False
            link()
        params, trained, problem = dict(self.engine.module.named_parameters()), self.trained_names(), None
        ends = [name for names in self.engine.param_group_names for name in (names[0], names[-1])]
        for name in [n for n in dict.fromkeys(ends) if n in trained and n in loadable]:
            # The fp32 master, and with the optimizer's state Adam's moments: one full copy at a time on the device.
            for key in ("value", *MOMENTS) if optimizer_states else ("value",):
                param = params[name]
                got = safe_get_full_fp32_param(param) if key == "value" else safe_get_full_optimizer_state(param, key)
                if got is None or (name, key) not in self.pieces:
                    continue
                got = got.detach().float().flatten().cpu()  # from here on the device holds no copy
                # Every rank goes through every getter (collectives) before any says what differed.
                differs = any(not torch.equal(got[i : i + len(v)], v.float()) for i, v in self.pieces[name, key])
                if problem is None and differs:
                    why = f"DeepSpeed {deepspeed.__version__}'s getters read back another {key} for {name}"
                    fix = "its private layout differs from the one this file writes (DeepSpeed 0.19.8)"
                    problem = f"checkpoint {self.ckpt_dir} loaded, but {why}: {fix}; do not train on"
        return problem

    def groups_and_masters(self):
        """(each group's 16-bit parameters, each group's fp32 masters) of this engine's optimizer (the table)."""
        if self.kind in WRAPPERS:
            params, masters = WRAPPERS[self.kind]
            return getattr(self.optimizer, params), getattr(self.optimizer, masters)
        if isinstance(self.optimizer, torch.optim.Optimizer) and self.engine.zero_optimization_stage() == 0:
            params = [group["params"] for group in self.optimizer.param_groups]
            return params, params  # fp32 at ZeRO 0: the parameters are their own masters
        readable = ", ".join(["torch's optimizer at ZeRO 0", *WRAPPERS])
        raise ValueError(f"load_ckpt writes into {readable}; this engine's optimizer is {self.kind}")

    def trained_names(self) -> set:
        return {self.names[id(p)] for params in self.groups_and_masters()[0] for p in params}

    def owned_fragments(self):
        """Each fragment of a trained parameter that this rank's optimizer steps, with the master holding it."""
        for params, master in zip(*self.groups_and_masters(), strict=True):
            if self.kind in FLAT_RANGES:  # a parameter's _hp_mapping says which part of the range is its
                for p in [p for p in params if p._hp_mapping is not None]:  # None: no part of p lies in this range
                    # lp: the 16-bit (low-precision) parameter; hp: its fp32 (high-precision) master.
                    lp, hp = p._hp_mapping.lp_fragment_address, p._hp_mapping.hp_fragment_address
                    yield Fragment(self.names[id(p)], lp.start, hp.start, lp.numel), master
            elif self.kind == "DeepSpeedZeroOptimizer_Stage3":  # a flat partition per sub-group
                shapes = {self.names[id(p)]: p.ds_shape for p in params}
                for fragment in zero3_layout(shapes, dist.get_world_size(), dist.get_rank()):
                    yield fragment, master
            else:  # ZeRO 0: whole parameters, their masters a list alike
                for p, own_master in zip(params, master, strict=True):
                    yield Fragment(self.names[id(p)], 0, 0, p.numel()), own_master

    def state_keys(self, base) -> set:
        """The state keys this run's optimizer steps with, which must be the saved ones: refuses otherwise."""
        amsgrad = any(group.get("amsgrad") for group in self.groups)  # the saved hyperparameters come along
        if isinstance(base, deepspeed.ops.adam.DeepSpeedCPUAdam):
            expected = set(MOMENTS)
        elif type(base) in (torch.optim.Adam, torch.optim.AdamW):
            expected = set(MOMENTS) | ({"max_exp_avg_sq"} if amsgrad else set())
        else:
            why = f"load_ckpt carries the state of torch's Adam and AdamW and of DeepSpeedCPUAdam, not {type(base)}"
            raise ValueError(f"{why}: pass load_optimizer_states=False to load the weights and the schedule alone")
        if self.saved_keys and self.saved_keys != expected:
            differ = f"saved {sorted(self.saved_keys)}, {type(base).__name__} here steps with {sorted(expected)}"
            raise ValueError(f"checkpoint {self.ckpt_dir} holds other optimizer state: {differ}")
        return expected

    def check_groups(self) -> None:
        """Refuses another grouping: the optimizer's groups, their hyperparameters and the scheduler's per-group
        lists pair by position, so each group of this run may hold, of the saved groups' parameters, only those of
        the saved group at its place (fewer will do: a layer frozen since)."""
        here, saved = self.engine.param_group_names, self.done["groups"]
        owner = {name: index for index, names in enumerate(saved) for name in names}
        if len(here) > len(saved) or any(owner.get(n, i) != i for i, names in enumerate(here) for n in names):
            why = f"saved {saved}, here {here}: build the optimizer's groups in the saving run's order"
            raise ValueError(f"checkpoint {self.ckpt_dir}'s optimizer groups do not match this run's: {why}")

    def saved_ranks(self, wanted) -> list:
        """The saving ranks (ZeRO 1-3) whose files hold a slice of wanted ([(name, first element, length)]), and
        the one of this rank's number (so some file gives the optimizer's groups). At ZeRO 3 saving rank r holds
        elements [r * size, (r + 1) * size) of each parameter; at ZeRO 1-2 the record's "holds" says what each
        file holds."""
        world_size = self.done["world_size"]
        ranks = {dist.get_rank() % world_size}
        spans = {}  # ZeRO 1-2: {name: [(saving rank, first element, length)]}
        for name, held in self.done["holds"].items():
            for param, (start, length) in held.items():
                spans.setdefault(param, []).append((saving_rank(name), start, length))
        for name, start, length in wanted:
            if self.done["zero_stage"] == 3:
                size = zero3_slice(math.prod(self.done["tensors"][name]), world_size, 0)[2]
                ranks.update(range(start // size, min(world_size, (start + length - 1) // size + 1)))
            else:
                ranks.update(r for r, low, count in spans.get(name, []) if low < start + length and start < low + count)
        return sorted(ranks)

    def read_file(self, name):
        """A saved file, checked (load_file) and memory-mapped (its tensors are read from disk only where they are
        sliced), once."""
        if name not in self.opened:
            self.opened[name] = load_file(os.path.join(self.ckpt_dir, name), self.done, mmap=True, weights_only=False)
        return self.opened[name]

    def optimizer_file(self, rank: int) -> str:
        """Rank's optimizer file at ZeRO 1-3, found by the end of its name (bf16 runs prefix it with bf16_)."""
        return next(n for n in self.done["files"] if n.endswith(f"pp_rank_{rank}_mp_rank_00_optim_states.pt"))

    def add(self, name, key, start, tensor, offset=0, length=None) -> None:
        """Record tensor as a piece of (name, key) from element start on: its flattened elements [offset, offset +
        length), or all."""
        end = None if length is None else offset + length
        self.pieces.setdefault((name, key), []).append(Piece(start, tensor.reshape(-1)[offset:end]))

    def add_saved(self, name, start, value, state, offset=0, length=None) -> None:
        """One saved fragment of a trained parameter, as add() records it: its fp32 value, and the optimizer's state of
        its parameter (ZeRO 0) or flat range (ZeRO 1-3), its moments and its step. Steps are all the run's step
        count, except where a parameter never had a gradient (none yet): so the largest is the one to resume from."""
        self.add(name, "value", start, value, offset, length)
        self.steps.append(state.get("step", 0))
        for key in state.keys() - {"step"}:
            self.saved_keys.add(key)
            self.add(name, key, start, state[key], offset, length)

    def read_zero0(self, model_states) -> list:
        """ZeRO 0: rank 0's model file holds everything whole: the weights, torch's optimizer state by parameter
        index (in the groups' order, whose names save_ckpt recorded) and, at bf16, fp32 copies of the weights.
        Returns the groups' hyperparameters."""
        optimizer = model_states["optimizer"]
        torch_state = optimizer.get("optimizer_state_dict", optimizer)  # bf16 wraps it, with fp32 copies
        for g, (group, names) in enumerate(zip(torch_state["param_groups"], self.done["groups"], strict=True)):
            for i, (index, name) in enumerate(zip(group["params"], names, strict=True)):
                value = optimizer["fp32_groups"][g][i] if "fp32_groups" in optimizer else model_states["module"][name]
                # {} for a parameter that never had a gradient (no moments, step 0), as in ZeRO 1-3's files.
                self.add_saved(name, 0, value, torch_state["state"].get(index, {}))
        return torch_state["param_groups"]

    def read_zero12(self, ranks) -> list:
        """ZeRO 1 and 2: each rank's optimizer file holds one flat range of fp32 weights per group, and Adam's
        moments alike; its param_slice_mappings say where each parameter's fragment lies in it, and the record's
        holds which elements of the parameter that is. Returns the groups' hyperparameters (of the last file: every
        rank's are the same)."""
        for rank in ranks:
            name_of_file = self.optimizer_file(rank)
            held = self.done["holds"].get(name_of_file, {})  # none: the rank's range held only padding, no fragment
            saved = self.read_file(name_of_file)["optimizer_state_dict"]
            torch_state, flats = saved["base_optimizer_state"], saved["single_partition_of_fp32_groups"]
            for g, (flat, mapping) in enumerate(zip(flats, saved["param_slice_mappings"], strict=True)):
                for name, fragment in mapping.items():
                    start = held[name][0]
                    self.add_saved(name, start, flat, torch_state["state"].get(g, {}), fragment.start, fragment.numel)
        return torch_state["param_groups"]

    def read_zero3(self, param_shapes, frozen, ranks) -> list:
        """ZeRO 3: each rank's optimizer file holds one flat partition per sub-group (param_shapes lists each
        sub-group's parameters): each parameter's ZeRO 3 slice, in order. Each rank's model file holds its slices
        of the parameters no optimizer held when saved (frozen; read only where there are any): DeepSpeed's frozen
        ones and this file's UNHELD. Returns the groups' hyperparameters."""
        world_size, tensors = self.done["world_size"], self.done["tensors"]
        for rank in ranks:
            saved = self.read_file(self.optimizer_file(rank))["optimizer_state_dict"]
            torch_state, flats = saved["optimizer_state_dict"], saved["fp32_flat_groups"]
            for g, (flat, shapes) in enumerate(zip(flats, param_shapes, strict=True)):
                for name, start, offset, length in zero3_layout(shapes, world_size, rank):
                    self.add_saved(name, start, flat, torch_state["state"].get(g, {}), offset, length)
            if frozen:
                states = self.read_file(model_states_file(3, rank))
                for name, fragment in {**(states["frozen_param_fragments"] or {}), **states.get(UNHELD, {})}.items():
                    start, length, _ = zero3_slice(math.prod(tensors[name]), world_size, rank)
                    self.add(name, "value", start, fragment, 0, length)
        return torch_state["param_groups"]


def replay_bias_corrections(optimizer, steps: int) -> None:
    """DeepSpeedCPUAdam's compiled side keeps beta1 ** step and beta2 ** step as running products, one multiplication
    a step, which no checkpoint holds; a fresh one at step n computes pow(beta, n), a few ulps away, and a resumed
    run drifts from the uninterrupted one (0.0047 in 10 steps on an H200). Stepping a one-element stand-in through
    steps 1..steps, each group in turn as the optimizer steps them, makes the products the run's own."""
    stand_in = [torch.zeros(1) for _ in range(4)]  # a weight, its gradient and its two moments
    for step in range(1, steps + 1):
        for group in optimizer.param_groups:
            beta1, beta2 = group["betas"]
            # As DeepSpeedCPUAdam.step calls it: (its id, the step, lr, beta1, beta2, eps, weight decay, bias
            # correction, then the weight, its gradient and the moments); lr 0 and a zero gradient change nothing.
            optimizer.ds_opt_adam.adam_update(optimizer.opt_id, step, 0.0, beta1, beta2, 1.0, 0.0, True, *stand_in)


def read_elements(pieces, start: int, length: int, required=True) -> torch.Tensor:
    """Elements [start, start + length) of a flattened tensor, from its saved pieces; where none lies zeros (the
    moments of a parameter that never had a gradient), or, if required, an error: a file that should hold them
    was not read. Only the slices that overlap are read."""
    values = torch.zeros(length, dtype=pieces[0].values.dtype if pieces else torch.float32)
    found = 0
    for piece_start, piece in pieces:
        low, high = max(start, piece_start), min(start + length, piece_start + piece.numel())
        if low < high:
            values[low - start : high - start] = piece[low - piece_start : high - piece_start]
            found += high - low
    if required and found < length:
        raise ValueError(f"the files read hold {found} of the elements [{start}, {start + length}) of a tensor")
    return values


def zero3_slice(numel: int, world_size: int, rank: int):
    """ZeRO 3's partition of a flattened tensor: each rank holds size = ceil(numel / world_size) elements from
    rank * size on; elements past numel, at the end of the last ranks' slices, are zero padding. Returns (start,
    length of the real elements, size)."""
    size = (numel + world_size - 1) // world_size  # numel / world_size, rounded up
    return rank * size, max(0, min(size, numel - rank * size)), size


def zero3_layout(shapes: dict, world_size: int, rank: int):
    """A Fragment for each parameter's slice in a ZeRO 3 flat partition, one partition per sub-group and rank:
    the parameters' slices one after the other, in order, each taking its full size."""
    offset = 0
    for name, shape in shapes.items():
        start, length, size = zero3_slice(math.prod(shape), world_size, rank)
        yield Fragment(name, start, offset, length)
        offset += size


def partition_span(tensor):
    """(first element, length) of what this rank holds of a module's parameter or buffer: at ZeRO 3 its
    partition of a parameter, otherwise all of it."""
    if hasattr(tensor, "ds_tensor"):
        return zero3_slice(tensor.ds_numel, dist.get_world_size(), dist.get_rank())[:2]
    return 0, tensor.numel()


def write_tensor(tensor, pieces) -> None:
    """Write what this rank holds of a module's parameter or buffer (partition_span) from the pieces of its
    flattened values."""
    start, length = partition_span(tensor)
    if hasattr(tensor, "ds_tensor"):  # ZeRO 3: this rank's partition
        tensor.ds_tensor.data.view(-1)[:length] = read_elements(pieces, start, length)
    else:
        tensor.data.copy_(read_elements(pieces, 0, length).view(tensor.shape))


def gather_persistent(module) -> None:
    """At ZeRO 3, after their partitions were written: every whole copy a parameter still holds goes (the small
    ones every rank keeps between uses, ds_persist, and any an evaluation's forward left gathered, which the next
    forward would use as they are), then the small ones are gathered anew, as DeepSpeed does after its own load
    (collective)."""
    whole = [p for p in module.parameters() if hasattr(p, "ds_tensor") and p.ds_status.name == "AVAILABLE"]
    if whole:
        whole[0].partition(whole)  # the stale whole copies go; the partitions stay
    persistent = [p for p in module.parameters() if getattr(p, "ds_persist", False)]
    if persistent:
        persistent[0].all_gather(persistent)
