"""A DeepSpeed training strategy in one file: seeding, distributed set-up, the ds_config for ZeRO 0-3,
prepare/backward/step wrappers, rank helpers and checkpoints.

It imports only the standard library, torch and deepspeed, so you can copy it into your own trainer. Method
names and signatures follow OpenRLHF 0.8.5's DeepspeedStrategy: its SFT, reward-model and DPO trainers run on
this file with two import lines changed (README, "Running OpenRLHF's trainers").

Use it in a training script, with args from your argparse parser (README, "Using it in your trainer", shows one;
it needs --zero_stage, and --local_rank under the deepspeed launcher):

    strategy = get_strategy(args)
    strategy.setup_distributed()
    optimizer = strategy.create_optimizer(model, lr=1e-3, weight_decay=0.1)
    model, optimizer, scheduler = strategy.prepare((model, optimizer, scheduler))
    for batch in strategy.setup_dataloader(dataset, strategy.micro_train_batch_size):
        loss = loss_fn(model(batch))
        strategy.backward(loss, model, optimizer)
        strategy.optimizer_step(optimizer, model, scheduler)  # steps once every accumulated_gradient calls
    strategy.teardown()  # see its docstring: ends the process group before Python shuts down

and launch it with `deepspeed train.py`, `torchrun --nproc_per_node N train.py` or plain `python train.py`
(README, "Launching"). On a CPU-only machine the ranks talk over gloo.

Batch sizes, as DeepSpeed counts them: train_batch_size = micro_train_batch_size * world_size *
accumulated_gradient, the samples of one optimizer step over all ranks and accumulation steps.
"""

import gc
import itertools
import json
import math
import os
import pickle
import random
import shutil
import signal
import socket
import tempfile
import zipfile
from datetime import timedelta

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from torch.utils.data import DataLoader

try:  # seeded and checkpointed when present; DeepSpeed itself requires NumPy, so vendoring adds nothing
    import numpy
except ImportError:
    numpy = None

# -------------------------------------------------------------------------------------------------------------
# Defaults. get_strategy() reads each flag once, falling back to these; the constructor uses the same constants,
# so every default is written here and nowhere else.
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
LOCAL_RANK = -1  # -1: take the local rank from the launcher's LOCAL_RANK environment variable

# Where launchers put the world size and this process's rank on its node: torchrun and the deepspeed launcher,
# then MPI launchers (Open MPI, MVAPICH, MPICH and Intel MPI), whose variables exist before DeepSpeed's discovery.
WORLD_SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMI_SIZE")
LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")

# OpenRLHF's flags for what this file leaves out, with the value meaning "off": get_strategy refuses any other.
LEFT_OUT = {
    "ring_attn_size": (1, "ring attention (sequence parallelism)"),
    "ds_tensor_parallel_size": (1, "DeepSpeed tensor parallelism"),
    "zpg": (1, "ZeRO++ hierarchical weight partitioning"),
    "use_ds_universal_ckpt": (False, "DeepSpeed universal checkpoints"),
    "deepcompile": (False, "DeepSpeed's compiler (deepcompile)"),
}

# Files a checkpoint folder holds besides DeepSpeed's own.
RNG_FILE = "rng_state_rank{rank}.pt"  # each rank's random generators, which DeepSpeed does not save
DONE_FILE = "checkpoint_complete.json"  # written once every rank has saved: its absence means incomplete
STAGING = ".saving"  # save_ckpt writes <tag>.saving, renamed to <tag> once complete
REPLACED = ".replaced"  # an older <tag> while the new one takes its name


class DeepspeedStrategy:
    """Everything a DeepSpeed trainer needs around its model: set-up, configuration, the training step's
    wrappers, collective helpers and checkpoints. Build it with get_strategy(args)."""

    def __init__(self, seed=SEED, full_determinism=FULL_DETERMINISM, max_norm=MAX_NORM,
                 micro_train_batch_size=MICRO_TRAIN_BATCH_SIZE, train_batch_size=TRAIN_BATCH_SIZE,
                 zero_stage=ZERO_STAGE, bf16=BF16, args=None, *, adam_offload=ADAM_OFFLOAD, overlap_comm=OVERLAP_COMM,
                 grad_accum_dtype=GRAD_ACCUM_DTYPE, local_rank=LOCAL_RANK) -> None:  # OpenRLHF's order, then ours
        # Check all that does not need the world size now, so a bad flag fails on every rank before any process
        # group exists. setup_distributed() checks the rest. Each condition guards its own type first.
        weights_dtype = "bf16" if bf16 is True else "fp32"
        rules = [
            ("--seed", seed, _is_int(seed), "must be a whole number"),
            ("--zero_stage", zero_stage, _is_int(zero_stage) and 0 <= zero_stage <= 3, "is not a ZeRO stage: use 0 "
             "(plain data parallel), 1 (shard optimizer states), 2 (and gradients) or 3 (and parameters)"),
            *((flag, value, _is_int(value) and value >= 1, "must be a whole number of samples >= 1") for flag, value in
              (("--micro_train_batch_size", micro_train_batch_size), ("--train_batch_size", train_batch_size))),
            *((flag, value, isinstance(value, bool), "must be True or False (an argparse store_true flag)")
              for flag, value in (("--full_determinism", full_determinism), ("--bf16", bf16),
                                  ("--adam_offload", adam_offload), ("--overlap_comm", overlap_comm))),
            ("--max_norm", max_norm, isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool)
             and 0 <= max_norm < float("inf"), "must be a finite number >= 0 (0 turns gradient clipping off)"),
            ("--grad_accum_dtype", grad_accum_dtype, grad_accum_dtype in (None, "fp32", "bf16", "fp16"),
             "must be fp32, bf16 or fp16, or left unset"),
            ("--grad_accum_dtype", grad_accum_dtype, zero_stage != 0 or grad_accum_dtype in (None, weights_dtype),
             f"needs --zero_stage 1, 2 or 3: at stage 0 DeepSpeed accumulates gradients in the weights' dtype "
             f"({weights_dtype}); drop the flag or raise the stage"),
            ("--adam_offload", adam_offload, not (adam_offload and zero_stage == 0), "needs --zero_stage 1, 2 or 3: "
             "ZeRO-Offload moves each rank's shard of the optimizer to the CPU, and stage 0 does not shard it"),
            ("--local_rank", local_rank, _is_int(local_rank) and local_rank >= -1,
             "must be -1 (read LOCAL_RANK) or a device index >= 0"),
        ]  # fmt: skip
        for flag, value, holds, problem in rules:
            if not holds:
                raise ValueError(f"{flag} {value!r} {problem}")

        self.args = args  # the trainer's own flags, kept for trainers that read strategy.args
        self.seed = seed
        self.full_determinism = full_determinism
        self.max_norm = max_norm
        self.micro_train_batch_size = micro_train_batch_size
        self.train_batch_size = train_batch_size
        self.stage = zero_stage
        self.bf16 = bf16
        self.adam_offload = adam_offload
        self.overlap_comm = overlap_comm
        self.grad_accum_dtype = grad_accum_dtype
        self.local_rank = local_rank  # setup_distributed() replaces -1 with the launcher's value
        self.world_size = None  # known after setup_distributed()
        self.accumulated_gradient = None  # micro-steps per optimizer step, known after setup_distributed()
        self.is_rlhf = False
        self._ema_calls = 0  # moving_average() updates on every accumulated_gradient-th call
        self._stop_signal = None  # preemption_signal(): None until its first call, then the signal received or 0

    # ---------------------------------------------------------------------------------------------------------
    # Seeding and distributed set-up

    def set_seed(self, seed: int) -> None:
        """Seed every generator a training step draws from, alike on every rank, so all build the same model."""
        random.seed(seed)
        if numpy is not None:
            numpy.random.seed(seed)
        torch.manual_seed(seed)  # the CPU generator and those of every visible accelerator

    def setup_distributed(self, timeout: timedelta = timedelta(minutes=60)) -> None:
        """Seed, pick this rank's device, join the process group and derive the accumulation steps.

        Works under the deepspeed launcher, torchrun and plain python (one process). Calling it again in the
        same process reseeds and reuses the existing process group."""
        self.set_seed(self.seed)
        if self.full_determinism:
            # cuBLAS splits reductions according to its workspace; a fixed workspace makes matmuls repeatable.
            # It is read when the first cuBLAS handle is made, which is why this runs before any CUDA work.
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
            # flash-attention's backward adds with atomics unless told not to (read by flash-attn and transformers).
            os.environ["FLASH_ATTENTION_DETERMINISTIC"] = "1"
            torch.use_deterministic_algorithms(True)  # raise instead of silently running a nondeterministic kernel
            torch.backends.cudnn.deterministic = True  # only deterministic convolution algorithms
            torch.backends.cudnn.benchmark = False  # no timing-based choice of algorithm, which varies run to run

        # Launchers export the rendezvous variables. Without one, describe a one-process world ourselves, or
        # deepspeed.init_distributed() goes looking for MPI. MPI launchers (mpirun) set their own variables.
        if not any(name in os.environ for name in WORLD_SIZE_VARS):
            for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
                os.environ.setdefault(name, value)
            os.environ.setdefault("MASTER_PORT", str(_free_port()))

        # The deepspeed launcher passes --local_rank; it takes precedence over the environment.
        if self.local_rank != -1:
            os.environ["LOCAL_RANK"] = str(self.local_rank)

        if not dist.is_initialized():
            # Check the batch sizes against the launcher's world size before the rendezvous: a rank that raised
            # inside it would leave the others waiting for the whole timeout.
            launched_world_size = next((os.environ[n] for n in WORLD_SIZE_VARS if n in os.environ), None)
            if launched_world_size is not None:
                self._set_world_size(int(launched_world_size))
            # nccl on CUDA; gloo on CPU, where DeepSpeed also builds a shared-memory all-reduce for ranks on one host.
            # Under mpirun this is also where DeepSpeed discovers the ranks and sets LOCAL_RANK.
            env, backend = os.environ, get_accelerator().communication_backend_name()
            where = f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}"
            try:
                if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                    # torchrun keeps one store across restarts: this attempt's keys get a prefix of their own, or a
                    # restarted rank reads the addresses of dead ranks. DeepSpeed then adopts this process group.
                    agent = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
                    store = dist.PrefixStore(f"attempt{env['TORCHELASTIC_RESTART_COUNT']}/", agent)
                    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
                    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
                deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
            except dist.DistNetworkError as error:  # the rendezvous port is taken
                if "EADDRINUSE" in str(error):
                    raise RuntimeError(f"port {where} is already in use, perhaps by another run on this machine: start "
                                       f"with another, for example --master_port {_free_port()} (the deepspeed "
                                       "launcher and torchrun both take it)") from error  # fmt: skip
                raise
            except dist.DistStoreError as error:  # a timeout, saying how many ranks arrived
                raise RuntimeError(f"not every rank arrived at {where} within {timeout} ({error}): check that all "
                                   "were started with the same --master_addr and --master_port") from error  # fmt: skip
        self._set_world_size(dist.get_world_size())
        # Only now is the local rank known under every launcher: it picks the device and each node's writer.
        self.local_rank = int(next((os.environ[n] for n in LOCAL_RANK_VARS if n in os.environ), "0"))
        get_accelerator().set_device(self.local_rank)  # CUDA: this rank's GPU; CPU: nothing to pick

    def teardown(self) -> None:
        """Wait for every rank, destroy the process group and collect garbage: call it once when the run is over.
        Without it a finished run can abort at exit ("terminate called without an active exception"): a gloo
        thread releasing DeepSpeed's last collective needs the interpreter lock as Python shuts down, and Python
        ends such threads. Two ranks on a loaded 2-core CPU: 3 of 40 runs aborted after barrier and destroy alone,
        none of 56 with the collection too (6 of 16 unloaded with no teardown at all)."""
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        gc.collect()  # while the interpreter still runs, so the workers' last releases happen now

    def _set_world_size(self, world_size: int) -> None:
        samples_per_micro_step = self.micro_train_batch_size * world_size
        if self.train_batch_size % samples_per_micro_step:
            lower = self.train_batch_size // samples_per_micro_step * samples_per_micro_step
            options = " or ".join(str(n) for n in (lower, lower + samples_per_micro_step) if n > 0)
            raise ValueError(
                f"--train_batch_size {self.train_batch_size} must be a multiple of --micro_train_batch_size * "
                f"world_size = {self.micro_train_batch_size} * {world_size} = {samples_per_micro_step} "
                f"(try {options})"
            )
        self.world_size = world_size
        self.accumulated_gradient = self.train_batch_size // samples_per_micro_step

    # ---------------------------------------------------------------------------------------------------------
    # DeepSpeed configuration

    def get_ds_train_config(self, is_actor: bool = False) -> dict:
        """The ds_config of a model that trains. is_actor is accepted for OpenRLHF's callers and changes nothing."""
        zero = {
            # 0: every rank holds everything (plain data parallel); 1: shard the optimizer states over ranks;
            # 2: also shard the gradients; 3: also shard the parameters, gathering each layer when it runs.
            "stage": self.stage,
            # ZeRO-Offload: keep this rank's optimizer shard in CPU memory and run Adam there (DeepSpeedCPUAdam).
            "offload_optimizer": {"device": "cpu" if self.adam_offload else "none", "pin_memory": True},
            # ZeRO 3 only: let save_model() gather the full weights on rank 0 instead of saving shards.
            "stage3_gather_16bit_weights_on_model_save": True,
            # Reduce gradient buckets while the backward pass still runs. Written either way: DeepSpeed's default
            # differs by stage (on at 3, off below), and an unwritten False would silently mean True at stage 3.
            "overlap_comm": self.overlap_comm,
        }
        config = {
            "train_micro_batch_size_per_gpu": self.micro_train_batch_size,  # samples per rank per forward/backward
            # Samples per optimizer step; DeepSpeed derives the accumulation steps as this / (micro * world size).
            "train_batch_size": self.train_batch_size,
            "gradient_clipping": self.max_norm,  # clip the global gradient L2 norm to this; 0 disables clipping
            "zero_optimization": zero,
            "bf16": {"enabled": self.bf16},  # bfloat16 weights and activations, fp32 master weights for the update
            "steps_per_print": 1 << 30,  # DeepSpeed's own periodic log, effectively off: the trainer reports progress
            "wall_clock_breakdown": False,  # no per-phase timers, which synchronise the device to read time
        }
        if self.grad_accum_dtype is not None:
            config["data_types"] = {"grad_accum_dtype": self.grad_accum_dtype}  # dtype gradients are summed in
        return config

    def get_ds_eval_config(self, offload: bool = False) -> dict:
        """The ds_config of a frozen model (a reference or reward model): no optimizer, no gradients. Only ZeRO 3
        saves memory without an optimizer, so the stage is 3 when training uses 3 and 0 otherwise. offload keeps
        the weights in CPU memory between uses; below ZeRO 3, where every rank holds the whole model, it is ignored."""
        zero = {
            "stage": 3 if self.stage == 3 else 0,  # shard the weights only when training does
            "stage3_gather_16bit_weights_on_model_save": True,  # let save_model() gather full weights
        }
        if offload and self.stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}  # ZeRO 3: fetch weights from CPU per layer
        return {
            "train_micro_batch_size_per_gpu": self.micro_train_batch_size,  # DeepSpeed checks batch sizes even here
            "train_batch_size": self.train_batch_size,  # likewise; an eval engine never steps
            "zero_optimization": zero,
            "bf16": {"enabled": self.bf16},  # the same weight dtype as the trained models
            "steps_per_print": 1 << 30,  # DeepSpeed's own periodic log, effectively off
            "wall_clock_breakdown": False,  # no per-phase timers
        }

    # ---------------------------------------------------------------------------------------------------------
    # Optimizer, prepare, backward and step

    def create_optimizer(self, model: torch.nn.Module, **kwargs) -> torch.optim.Optimizer:
        """AdamW with weight decay on weight matrices and embeddings, none on biases and norm weights (parameters
        of fewer than two dimensions); kwargs go to the optimizer. The model may already be sharded: built under
        deepspeed.zero.Init (as Hugging Face's from_pretrained does at ZeRO 3), or prepared. With adam_offload,
        DeepSpeedCPUAdam (compiled on first use); on CUDA torch's fused AdamW; elsewhere torch's AdamW."""
        weight_decay = kwargs.pop("weight_decay", 0.0)
        params = [p for p in self._unwrap_model(model).parameters() if p.requires_grad]
        is_matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in params]  # a ZeRO 3 shard's shape is (0,)
        groups = [
            {"params": [p for p, m in zip(params, is_matrix) if m], "weight_decay": weight_decay},
            {"params": [p for p, m in zip(params, is_matrix) if not m], "weight_decay": 0.0},
        ]
        # DeepSpeed drops an empty group, and a scheduler built on this optimizer would then count one too many.
        groups = [group for group in groups if group["params"]]
        if self.adam_offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
        if get_accelerator().device_name() == "cuda":
            return torch.optim.AdamW(groups, fused=True, **kwargs)
        return torch.optim.AdamW(groups, **kwargs)

    def prepare(self, *models_or_model_optim_pairs, is_rlhf: bool = False):
        """Wrap models in DeepSpeed engines. A (model, optimizer, scheduler) tuple trains: it becomes
        (engine, optimizer, scheduler) with the train config, and DeepSpeed steps the scheduler (which may be
        None) once per optimizer step. A bare model becomes an eval engine with the eval config. One argument
        returns one result; several return a list in the same order."""
        if self.world_size is None:
            raise RuntimeError("call strategy.setup_distributed() before strategy.prepare()")
        self.is_rlhf = is_rlhf
        prepared = []
        for item in models_or_model_optim_pairs:
            if isinstance(item, tuple):
                if len(item) != 3:
                    raise ValueError(f"prepare() takes (model, optimizer, scheduler) tuples, got {len(item)} items; "
                                     "pass None as the scheduler if there is none")  # fmt: skip
                prepared.append(self._init_train_engine(*item) if item[0] is not None else (None, None, None))
            else:
                prepared.append(self._init_eval_engine(item) if item is not None else None)
        return prepared[0] if len(prepared) == 1 else prepared

    def _init_train_engine(self, model, optimizer, scheduler):
        if optimizer is None:
            raise ValueError("prepare((model, optimizer, scheduler)) trains and needs an optimizer "
                             "(strategy.create_optimizer); pass the bare model for an eval engine")  # fmt: skip
        # The optimizer's groups by parameter name, before DeepSpeed regroups them: save_ckpt records them, since
        # a ZeRO 0 checkpoint keys Adam's state by position alone.
        names = {id(p): name for name, p in _engine(model).named_parameters()}
        group_names = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=_engine(model), optimizer=optimizer, lr_scheduler=scheduler, config=self.get_ds_train_config()
        )
        engine.param_group_names = group_names
        return _in_actor(model, engine), optimizer, scheduler

    def _init_eval_engine(self, model):
        # OpenRLHF marks a frozen model whose weights may live in CPU memory with an `_offload` attribute.
        engine, *_ = deepspeed.initialize(
            model=_engine(model), config=self.get_ds_eval_config(getattr(model, "_offload", False))
        )
        return _in_actor(model, engine)

    def backward(self, loss: torch.Tensor, model, optimizer, **kwargs) -> None:
        """Backward through the engine: it divides the loss by the accumulation steps and, at ZeRO 2 and 3,
        reduces the gradients to their owning ranks."""
        _engine(model).backward(loss)

    def optimizer_step(self, optimizer, model, scheduler, name: str = "model", **kwargs) -> None:
        """One micro-step of the engine. On the last micro-step of an accumulation it averages the gradients
        over ranks, clips them to max_norm, steps the optimizer and the scheduler, and zeroes the gradients."""
        _engine(model).step()

    @staticmethod
    def _unwrap_model(model) -> torch.nn.Module:
        """The plain module inside an engine, an OpenRLHF Actor, or both."""
        engine = _engine(model)
        return engine.module if isinstance(engine, deepspeed.DeepSpeedEngine) else engine

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
        if isinstance(data, dict):
            reduced = {key: self.all_reduce(data[key], op) for key in self._keys_in_rank_order(data, "all_reduce")}
            return {key: reduced[key] for key in data}  # in the caller's order
        if not isinstance(data, torch.Tensor):  # Python bool, int or float: a float64 for floats, exact otherwise
            data = torch.tensor(data, dtype=torch.float64 if isinstance(data, float) else None)
            return self.all_reduce(data, op).item()
        self._require_process_group("all_reduce")
        exact = not data.is_floating_point() and not data.is_complex()  # bool or integer
        tensor = data.detach().to(get_accelerator().current_device_name(), torch.int64 if exact else None, copy=True)
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
        if isinstance(data, dict):
            gathered = {key: self.all_gather(data[key]) for key in self._keys_in_rank_order(data, "all_gather")}
            return {key: gathered[key] for key in data}
        if not isinstance(data, torch.Tensor):
            data = torch.tensor([data], dtype=torch.float64 if isinstance(data, float) else None)
        self._require_process_group("all_gather")
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

    def _keys_in_rank_order(self, data: dict, what: str) -> list:
        """data's keys sorted, once every rank is known to hold the same: otherwise unrelated values would pair."""
        self._require_process_group(what)
        keys = sorted(data, key=repr)
        every_rank = [None] * self.world_size
        dist.all_gather_object(every_rank, [repr(key) for key in keys])
        if any(rank_keys != every_rank[0] for rank_keys in every_rank):
            raise ValueError(f"{what} of a dict needs the same keys on every rank; got per rank: {every_rank}")
        return keys

    def preemption_signal(self) -> int:
        """The signal any rank was sent since the first call, which starts listening: SIGTERM (sent before a job is
        killed) or SIGUSR1 (SLURM's advance notice); 0 if none. Call it on every rank between optimizer steps (one
        small all-reduce); on a signal, save a checkpoint and exit with 128 + it, as train_example.py does."""
        if self._stop_signal is None:
            self._stop_signal = 0
            for signum in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(signum, lambda signum, frame: setattr(self, "_stop_signal", signum))
        return self.all_reduce(self._stop_signal, "max")

    def _require_process_group(self, what: str) -> None:
        if self.world_size is None or not dist.is_initialized():
            raise RuntimeError(f"call strategy.setup_distributed() before strategy.{what}()")

    def setup_dataloader(self, dataset, batch_size: int, pin_memory: bool = False, shuffle: bool = True,
                         collate_fn=None, drop_last=True, sampler=None, consumed_samples=0) -> DataLoader:  # fmt: skip
        """A DataLoader over this rank's disjoint shard of dataset (without drop_last, padded with repeats), shuffled
        by seed and epoch; consumed_samples (over all ranks) skips that many, so a resumed run continues. Each
        later pass is the next epoch; loader.sampler.set_epoch(epoch, consumed_samples) chooses one."""
        if sampler is None:
            sampler = DistributedSampler(dataset, num_replicas=self.world_size or 1, rank=self.get_rank(),
                                         shuffle=shuffle, seed=self.seed, drop_last=drop_last,
                                         consumed_samples=consumed_samples)  # fmt: skip
        # Its own generator: starting an epoch would otherwise draw from the global torch generator and shift every
        # random number after it (dropout masks), so a resumed run would diverge.
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                          pin_memory=pin_memory, drop_last=drop_last, generator=generator)  # fmt: skip

    # ---------------------------------------------------------------------------------------------------------
    # Checkpoints (to resume training) and model weights (to use the result)

    def save_ckpt(self, model, save_dir, tag=None, max_num=3, max_mem=1000, client_state=None, save_latest=True):
        """Save a checkpoint that resumes exactly: DeepSpeed's model, optimizer and scheduler states, client_state
        (your loop's counters) and every rank's random generators. All ranks must call it, and save_dir must be on
        a filesystem every rank sees. Every rank writes into save_dir/<tag>.saving (default tag global_step<N>) and
        makes its files durable (fsync); then rank 0 writes checkpoint_complete.json, swaps the folder in as
        save_dir/<tag>, and only then points save_dir/latest at it, so a crash or a power cut at any moment leaves
        the previous complete checkpoint loadable. Then the oldest complete checkpoints go until at most max_num
        and max_mem GB remain (never the new one or latest's)."""
        if not _is_int(max_num) or max_num < 1:
            raise ValueError(f"save_ckpt max_num {max_num!r} must be a whole number >= 1")
        engine = _engine(model)
        tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
        staging = os.path.join(save_dir, tag + STAGING)
        if self.is_rank_0():
            shutil.rmtree(staging, ignore_errors=True)  # left by a save that crashed
            os.makedirs(staging)
        dist.barrier()
        rank = self.get_rank()
        torch.save(_get_rng_states(), os.path.join(staging, RNG_FILE.format(rank=rank)))
        engine.save_checkpoint(save_dir, tag=tag + STAGING, client_state=client_state or {}, save_latest=False)
        for name in os.listdir(staging):  # on disk, not only in the page cache, before rank 0 commits
            if _written_by(name, rank):
                _fsync(os.path.join(staging, name))
        _fsync(staging)
        dist.barrier()  # every rank's files are durable
        if self.is_rank_0():  # one writer for every shared file
            self._commit_checkpoint(engine, save_dir, tag, save_latest)
            self._rotate_checkpoints(save_dir, max_num=max_num, max_bytes=max_mem * 1024**3, keep=tag)
        dist.barrier()

    def _commit_checkpoint(self, engine, save_dir, tag, save_latest):
        folder, staging = os.path.join(save_dir, tag), os.path.join(save_dir, tag + STAGING)
        files = {}
        for root, _, names in os.walk(staging):
            for name in names:
                path = os.path.join(root, name)
                files[os.path.relpath(path, staging)] = os.path.getsize(path)
        # What the run looked like, for load_ckpt: its shape, and the model's tensors and optimizer groups by name.
        done = {
            "world_size": self.world_size,
            "zero_stage": self.stage,
            "bf16": self.bf16,
            "adam_offload": self.adam_offload,
            "tensors": _tensor_shapes(engine.module),
            "groups": getattr(engine, "param_group_names", None),
            "files": files,
        }
        _write_atomically(os.path.join(staging, DONE_FILE), json.dumps(done, indent=1))
        if os.path.exists(folder):  # saving over a tag: keep the old folder complete until the new one is in place
            shutil.rmtree(folder + REPLACED, ignore_errors=True)
            os.rename(folder, folder + REPLACED)
        os.rename(staging, folder)
        _fsync(save_dir)  # the rename itself survives a power cut
        if save_latest:
            _write_atomically(os.path.join(save_dir, "latest"), tag)
        shutil.rmtree(folder + REPLACED, ignore_errors=True)

    def _rotate_checkpoints(self, save_dir, max_num, max_bytes, keep):
        protected = {keep, _read_latest(save_dir)}
        ours = _complete_checkpoints(save_dir)
        sizes = {name: _folder_bytes(os.path.join(save_dir, name)) for name in ours}
        count, total = len(ours), sum(sizes.values())
        for name in ours:  # oldest first
            if count <= max_num and total <= max_bytes:
                break
            if name not in protected:
                shutil.rmtree(os.path.join(save_dir, name))
                count, total = count - 1, total - sizes[name]

    def load_ckpt(self, model, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                  load_lr_scheduler_states=True, load_module_only=False):  # fmt: skip
        """Load a checkpoint written by save_ckpt into a prepared engine and restore this rank's random generators;
        returns (load_path, client_state). Any run shape resumes: another number of ranks, ZeRO stage, dtype or
        adam_offload (README, "Checkpoints and resuming"). Every file is checked first (sizes and CRCs, the work
        spread over the ranks); with tag None, a checkpoint that fails is named and the newest one that passes is
        used; a named tag that fails, or a checkpoint of another model, raises on every rank before anything loads.
        load_module_only=True loads the weights alone.

        Load only checkpoints you trust: DeepSpeed unpickles its files (torch.load with weights_only=False), so a
        crafted checkpoint runs code as it loads. Exchange weights with save_model and load_model instead."""
        engine = _engine(model)
        folder, done = self._choose_checkpoint(load_dir, tag)
        ckpt_dir = os.path.join(load_dir, folder)
        if load_module_strict:
            self._raise_on_every_rank(_model_mismatch(done, engine.module, ckpt_dir), ValueError)
        saved_shape = (done["world_size"], done["zero_stage"], done["bf16"], done.get("adam_offload", self.adam_offload))
        native = saved_shape == (self.world_size, self.stage, self.bf16, self.adam_offload) and not load_module_only
        if not native and done.get("groups") is None:
            self._raise_on_every_rank(f"checkpoint {ckpt_dir} was saved by an older get_strategy.py, which did not "
                                      "record its tensors: resume it in the shape that saved it", ValueError)  # fmt: skip
        rng_file = os.path.join(ckpt_dir, RNG_FILE.format(rank=self.get_rank()))
        error = None
        try:
            if native:  # DeepSpeed's own load, bit-exact
                load_path, client_state = engine.load_checkpoint(
                    load_dir, folder, load_module_strict=load_module_strict,
                    load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=load_lr_scheduler_states,
                )  # fmt: skip
            else:
                optimizer_states = load_optimizer_states and not load_module_only
                load_path, client_state = _load_in_new_shape(engine, ckpt_dir, done, optimizer_states)
                if not load_module_only:
                    _load_engine_state(engine, client_state, load_lr_scheduler_states)
            rng_states = torch.load(rng_file, weights_only=True) if os.path.isfile(rng_file) else None
        except Exception as caught:  # name it, and let no rank go on alone
            error = f"checkpoint {ckpt_dir} does not load: {caught!r}"
        self._raise_on_every_rank(error, RuntimeError)
        if not native and self.stage in (1, 2):
            engine.optimizer.update_lp_params()  # collective: each rank's new fp32 shard into everyone's weights
        if rng_states is not None:
            _set_rng_states(rng_states)
        else:  # a rank the saving run did not have: a seed of its own, the same on every rerun
            self.set_seed(self.seed + 1000 * engine.global_steps + self.get_rank())
        return load_path, client_state

    def _choose_checkpoint(self, load_dir, tag):
        """(folder, record) of the checkpoint to load, every file checked. With tag None: latest's, else the newest
        that passes; a named tag that fails, or no checkpoint at all, raises on every rank."""
        candidates = [tag]
        if tag is None:  # 'latest' names the checkpoint; if it was lost or fails, the next newest stands in
            newest_first = list(reversed(_complete_checkpoints(load_dir)))
            latest = _read_latest(load_dir)
            if latest is None and newest_first:
                self.print(f"{load_dir} has no 'latest' file: resuming from its newest complete checkpoint, "
                           f"{newest_first[0]}")  # fmt: skip
            candidates = [latest] * (latest is not None) + [name for name in newest_first if name != latest]
        first_problem = None
        for name in candidates:
            folder, done, problem = self._find_checkpoint(load_dir, name)
            problem = self._first_problem(problem)
            if problem is None:
                problem = self._first_problem(_damaged_record(load_dir, folder, done, self.get_rank(), self.world_size))
            if problem is None:
                if first_problem is not None:
                    self.print(f"{first_problem[1]}: resuming from {name} instead, the newest checkpoint that passes")
                return folder, done
            first_problem = first_problem or problem
        if first_problem is None:
            first_problem = (FileNotFoundError, f"no checkpoint to resume in {load_dir}: it holds no complete checkpoint")
        raise first_problem[0](first_problem[1])

    def _first_problem(self, problem):
        """The first rank's problem, as every rank sees it: (error type, message), or None when no rank has one."""
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        return next((p for p in problems if p), None)

    def _raise_on_every_rank(self, problem, error_type) -> None:
        """Raise error_type on every rank if any rank has a problem (a string): none then waits alone."""
        found = self._first_problem(problem)
        if found:
            raise error_type(found)

    def _find_checkpoint(self, load_dir, tag):
        """(folder holding tag's complete checkpoint, its record, None), or (None, None, (error type, why not))."""
        # A save over an existing tag that crashed while swapping folders left a complete one under another name.
        for folder in (tag, tag + STAGING, tag + REPLACED):
            try:
                with open(os.path.join(load_dir, folder, DONE_FILE)) as f:
                    done = json.load(f)
                break
            except (OSError, ValueError):
                continue
        else:
            return None, None, (FileNotFoundError, f"checkpoint {os.path.join(load_dir, tag)} is missing or "
                                f"incomplete as {socket.gethostname()} sees it (no {DONE_FILE}): the run may have "
                                "stopped while saving it, or this node cannot see the folder (checkpoints need a "
                                "filesystem every node shares); load an earlier tag")  # fmt: skip
        ckpt_dir = os.path.join(load_dir, folder)
        done = {"zero_stage": self.stage, "bf16": self.bf16, **done}  # older checkpoints did not record these
        if self.local_rank == 0:  # once per node: every file there, at the size it was written
            for name, size in done.get("files", {}).items():
                path = os.path.join(ckpt_dir, name)
                found = os.path.getsize(path) if os.path.isfile(path) else None
                if found != size:
                    state = "is missing" if found is None else f"has {found} bytes, not the {size} saved"
                    why = f"checkpoint file {path} {state} on {socket.gethostname()}: load an earlier tag"
                    return None, None, (FileNotFoundError, why)
        return folder, done, None

    def save_model(self, model, tokenizer, output_dir, **kwargs) -> None:
        """Write the full weights (gathered at ZeRO 3) to output_dir: pytorch_model.bin, or through the model's
        save_pretrained(output_dir, state_dict=...) when it has one, with a tokenizer's save_pretrained beside it.
        The keys are module.state_dict()'s and tied tensors stay tied; rank 0 writes each file under a temporary
        name and renames it. All ranks must call it. With load_model, the safe way to exchange weights."""
        module = self._unwrap_model(model)
        state_dict = self._full_state_dict(model)  # collective at ZeRO 3
        if self.is_rank_0():
            os.makedirs(output_dir, exist_ok=True)
            staging = tempfile.mkdtemp(prefix=".saving-", dir=output_dir)  # same filesystem, so renames are atomic
            try:
                if hasattr(module, "save_pretrained"):
                    module.save_pretrained(staging, state_dict=state_dict, **kwargs)
                else:
                    torch.save(state_dict, os.path.join(staging, "pytorch_model.bin"))
                if hasattr(tokenizer, "save_pretrained"):
                    tokenizer.save_pretrained(staging)
                for name in os.listdir(staging):
                    os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()

    def _full_state_dict(self, model) -> dict:
        """module.state_dict() as full CPU tensors on rank 0 ({} elsewhere): every key, also of a module under two
        names, and a tensor behind several keys copied once, so ties survive. ZeRO 3 gathers read-only, one
        submodule at a time (DeepSpeed's private _zero3_consolidated_16bit_state_dict broadcasts them back too)."""
        module = self._unwrap_model(model)
        copies = {}  # id of a parameter or buffer -> its full copy on CPU
        if _is_zero3(model):
            for submodule in module.modules():
                params = list(submodule.parameters(recurse=False))
                with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                    if self.is_rank_0():
                        copies.update({id(p): p.detach().cpu().clone() for p in params if id(p) not in copies})
        if not self.is_rank_0():
            return {}
        state_dict = {}
        for key, value in module.state_dict(keep_vars=True).items():
            if id(value) not in copies:
                # Clone: at ZeRO 1 and 2 parameters are views into one flat buffer that torch.save would write whole.
                copies[id(value)] = value.detach().cpu().clone()
            state_dict[key] = copies[id(value)]
        return state_dict

    def load_model(self, model, path, map_location="cpu", strict=False, key_replace_fn=None) -> None:
        """Load a state dict file into model (a module or an engine, which then trains on from it), reading tensors
        only (weights_only=True): a file carrying other objects is refused and its code never runs. The file's CRCs
        are checked first, the work spread over the ranks. A file none of whose keys the model has is refused even
        with strict=False; else rank 0 reports missing and extra keys. At ZeRO 3 each rank reads only its shards."""
        # Below ZeRO 3 this rank reads the whole file and checks it alone; at ZeRO 3, where every rank must call
        # this and reads only its shards, the ranks share the check.
        zero3 = _is_zero3(model)
        rank, world_size = (dist.get_rank(), dist.get_world_size()) if zero3 else (0, 1)
        folder, name = os.path.split(os.path.abspath(path))
        problem = None
        if zipfile.is_zipfile(path):  # torch.save's format; other formats carry no CRCs to check
            with zipfile.ZipFile(path) as archive:
                records = [(name, info) for info in archive.infolist()]
            problem = _damaged_among(folder, records[rank::world_size])
        if zero3:
            problem = self._first_problem(problem)
        if problem:
            raise ValueError(f"refusing to load {path}: {problem}")
        try:  # memory-mapped where the format allows: a tensor is read only where it is used
            state_dict = torch.load(path, map_location=map_location, weights_only=True, mmap=zipfile.is_zipfile(path))
        except pickle.UnpicklingError as error:
            raise ValueError(f"refusing to load {path}: it holds Python objects besides tensors, and unpickling "
                             f"them could run code; load a state dict (save_model writes one).\n{error}") from None
        if key_replace_fn is not None:
            state_dict = key_replace_fn(state_dict)
        self._load_state_dict(model, state_dict, strict, source=path)

    def _load_state_dict(self, model, state_dict, strict, source) -> None:
        """Load state_dict into model and into a training engine's fp32 master copy, which the next step would
        otherwise write back. At ZeRO 3 each rank writes only its own partition of each tensor."""
        module = self._unwrap_model(model)
        expected = list(module.state_dict())  # at ZeRO 3 too: partitioned parameters appear with empty shards
        if not set(state_dict) & set(expected):
            raise ValueError(f"none of the {len(state_dict)} keys in {source} is a key of the model: the file has "
                             f"{sorted(state_dict)[:3]}..., the model {sorted(expected)[:3]}... (key_replace_fn?)")
        if _is_zero3(model):
            tensors = dict(module.named_parameters(remove_duplicate=False))
            tensors.update(module.named_buffers(remove_duplicate=False))
            missing = [key for key in expected if key not in state_dict]
            unexpected = [key for key in state_dict if key not in tensors]
            for key in (key for key in state_dict if key in tensors):
                shape = tuple(getattr(tensors[key], "ds_shape", tensors[key].shape))
                if tuple(state_dict[key].shape) != shape:
                    raise RuntimeError(f"{source}: {key} has shape {tuple(state_dict[key].shape)}, the model {shape}")
            if strict and (missing or unexpected):
                raise RuntimeError(f"{source}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
            for key in (key for key in state_dict if key in tensors):
                value = state_dict[key].reshape(-1)
                _write_tensor(tensors[key], lambda start, length, value=value: value[start : start + length])
        else:
            result = module.load_state_dict(state_dict, strict=strict)
            missing, unexpected = result.missing_keys, result.unexpected_keys
        if missing or unexpected:
            self.print(f"loaded {source} with {len(missing)} missing keys {missing[:5]} and "
                       f"{len(unexpected)} unexpected keys {unexpected[:5]}")  # fmt: skip
        optimizer = getattr(_engine(model), "optimizer", None)
        if hasattr(optimizer, "refresh_fp32_params"):  # ZeRO 1-3, and bf16 at stage 0
            optimizer.refresh_fp32_params()

    # ---------------------------------------------------------------------------------------------------------
    # OpenRLHF's contracts: what its SFT, reward-model, DPO and PPO trainers use beyond the training path

    ring_attn_group = None  # ring attention's process group; OpenRLHF's models read None as "no ring attention"

    @torch.no_grad()
    def moving_average(self, model, model_ema, beta: float = 0.992, device="cpu") -> None:
        """OpenRLHF PPO's exponential moving average: on every accumulated_gradient-th call (once per optimizer
        step) each trainable weight of model_ema becomes beta * itself + (1 - beta) * model's, computed on device.
        All ranks must call it; at ZeRO 3 it gathers one pair of weights at a time."""
        self._ema_calls += 1
        if self._ema_calls % self.accumulated_gradient:
            return
        pairs = zip(self._unwrap_model(model).parameters(), self._unwrap_model(model_ema).parameters(), strict=True)
        for param, ema in pairs:
            if not param.requires_grad:
                continue
            # No-ops for weights that are not sharded. The EMA's gather keeps rank 0's result on exit.
            with deepspeed.zero.GatheredParameters([param]):
                with deepspeed.zero.GatheredParameters([ema], modifier_rank=0):
                    ema.data.copy_(beta * ema.data.to(device) + (1 - beta) * param.data.to(device))


class DistributedSampler(torch.utils.data.DistributedSampler):
    """torch's DistributedSampler that can start an epoch part-way, under the name and signature OpenRLHF's
    trainers import: set_epoch(epoch, consumed_samples) skips the epoch's first consumed_samples samples (over
    all ranks). Iterating again without a set_epoch call starts the next epoch, in a new order."""

    def __init__(self, dataset, num_replicas, rank, shuffle, seed, drop_last, consumed_samples=0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.set_epoch(0, consumed_samples)

    def set_epoch(self, epoch: int, consumed_samples: int = 0) -> None:
        super().set_epoch(epoch)
        self.skip = consumed_samples // self.num_replicas
        self.epoch_was_set = True

    def __iter__(self):
        if not self.epoch_was_set:
            self.set_epoch(self.epoch + 1)
        self.epoch_was_set = False
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return max(0, self.num_samples - self.skip)


# -------------------------------------------------------------------------------------------------------------
# OpenRLHF's Actor: a module that keeps the model it trains in its `model` attribute. Its prepare() puts the
# engine there (actor.model = engine) and returns the Actor, and every method then reaches the engine through it.


def _actor_inner(model):
    """The module an Actor wraps, else None. An Actor holds no parameters of its own and has no save_pretrained;
    a Hugging Face model's `.model` is its backbone, not a wrapper, and the model has save_pretrained."""
    if isinstance(model, deepspeed.DeepSpeedEngine):  # it forwards unknown attributes, `.model` too, to its module
        return None
    inner = getattr(model, "model", None)
    if not isinstance(inner, torch.nn.Module) or hasattr(model, "save_pretrained"):
        return None
    return inner if set(map(id, model.parameters())) <= set(map(id, inner.parameters())) else None  # none of its own


def _in_actor(model, engine):
    """What prepare() returns: an Actor, now holding the engine; otherwise the engine."""
    if _actor_inner(model) is None:
        return engine
    model.model = engine
    return model


def _engine(model):
    """The engine (or module) behind an Actor; anything else as it is."""
    inner = _actor_inner(model)
    return model if inner is None else inner


def _is_zero3(model) -> bool:
    engine = _engine(model)
    return isinstance(engine, deepspeed.DeepSpeedEngine) and engine.zero_optimization_partition_weights()


# -------------------------------------------------------------------------------------------------------------
# Resuming in another shape. DeepSpeed's own load needs the run shape that saved the checkpoint. For any other,
# load_ckpt reads the saved files directly, at load time, rather than saving a second shape-free copy of every
# checkpoint: saving stays as fast and as large as DeepSpeed's. Each saved file is memory-mapped, so a rank reads
# only the slices of each tensor it will hold, never the whole model; a full tensor exists only where the new run
# keeps one whole (ZeRO 0 below 3, and ZeRO 3's small resident parameters).
#
# Both sides speak of "pieces": the flattened tensor `name` from element `start` on, as 1-D tensors per key
# ("value": the fp32 master weight, or a frozen tensor; "exp_avg" and "exp_avg_sq": Adam's moments).

MOMENTS = ("exp_avg", "exp_avg_sq")


@torch.no_grad()
def _load_in_new_shape(engine, ckpt_dir, done, optimizer_states):
    """Write a checkpoint of another run shape into engine: fp32 master weights and, with optimizer_states, Adam's
    moments, step and each group's hyperparameters; frozen parameters and buffers; this rank's 16-bit weights
    except at ZeRO 1 and 2, where update_lp_params() must follow on every rank. Returns (path, saved states)."""
    pieces, groups, step, model_states = _saved_pieces(ckpt_dir, done)

    def reader(name, key):
        def read(start, length):  # elements [start, start + length) of the flattened tensor, from the pieces
            parts = []
            for piece_start, tensors in pieces[name]:
                source = tensors[key] if key in tensors else torch.zeros(tensors["value"].numel())
                low, high = max(start, piece_start), min(start + length, piece_start + source.numel())
                if low < high:
                    parts.append(source[low - piece_start : high - piece_start])
            return torch.cat(parts) if parts else torch.zeros(0)

        return read

    optimizer = engine.optimizer
    base = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's ZeRO and bf16 wrappers hold torch's optimizer
    for name, start, length, master, offset in _owned_slices(engine):
        keys = ("value", *MOMENTS) if optimizer_states else ("value",)
        if optimizer_states and not base.state.get(master):  # before the first step the state does not exist
            base.state[master] = {key: torch.zeros_like(master) for key in MOMENTS}
        for key in keys:
            destination = master if key == "value" else base.state[master][key]
            destination.view(-1).narrow(0, offset, length).copy_(reader(name, key)(start, length))
        if optimizer_states:
            # torch's optimizers count steps in a 0-d float tensor, DeepSpeedCPUAdam and FusedAdam in an int.
            own = type(base).__module__.startswith("torch.")
            base.state[master]["step"] = torch.tensor(float(step)) if own else step
    if optimizer_states:
        for group, saved in zip(optimizer.param_groups, groups, strict=True):
            for key in set(group) & set(saved) - {"params", "foreach", "fused", "capturable", "differentiable"}:
                group[key] = saved[key]  # hyperparameters (lr, betas, weight decay...), not how steps are computed
    module, trainable = engine.module, {name for names in done["groups"] for name in names}
    tensors = dict(module.named_parameters())
    tensors.update((name, buffer) for name, buffer in module.named_buffers() if name in done["tensors"])
    for name, tensor in tensors.items():
        if name not in trainable or engine.zero_optimization_stage() in (0, 3):
            _write_tensor(tensor, reader(name, "value"))  # ZeRO 1 and 2 gather their weights in update_lp_params
    return os.path.join(ckpt_dir, _model_states_file(done["zero_stage"])), model_states


def _load_engine_state(engine, states, load_lr_scheduler_states):
    """What DeepSpeed's own load restores besides the model and optimizer: the scheduler and the counters. Leaves
    in states only client_state: what save_ckpt's caller passed, and DeepSpeed's other records, as its load does."""
    if load_lr_scheduler_states and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(states["lr_scheduler"])
    engine.global_steps = states["global_steps"]
    engine.global_samples = states.get("global_samples", engine.global_steps * engine.train_batch_size())
    engine.skipped_steps = states["skipped_steps"]
    for key in ("module", "optimizer", "lr_scheduler", "global_steps", "skipped_steps", "dp_world_size",
                "mp_world_size", "data_sampler", "random_ltd"):  # fmt: skip
        states.pop(key, None)


def _model_states_file(stage):
    return "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"


def _saved_pieces(ckpt_dir, done):
    """Where every tensor of a saved checkpoint lies: ({name: [(start, {key: 1-D tensor})]}, the optimizer's saved
    param groups, Adam's step, the model-states dict). DeepSpeed's layouts, by the stage that saved:
    - 0: rank 0's model file holds everything whole: the weights, torch's optimizer state by parameter index
      (the indices follow the groups' order, whose names save_ckpt recorded) and, at bf16, fp32 copies per group.
    - 1 and 2: each rank's optimizer file holds one flat fp32 range per group, with Adam's moments alike, and
      param_slice_mappings: where in that range each parameter's fragment sits. A parameter's fragments in rank
      order make it whole.
    - 3: each rank's optimizer file holds one flat fp32 partition per sub-group: in order, each parameter's
      rank-th slice of ceil(numel / world_size) elements, zero-padded at the end; frozen parameters likewise in
      each rank's model file."""
    stage, world = done["zero_stage"], done["world_size"]

    def load(name):  # mmap: tensors are read from disk only where they are sliced
        return torch.load(os.path.join(ckpt_dir, name), map_location="cpu", mmap=True, weights_only=False)

    def optimizer_file(rank):  # bf16 runs prefix the name with bf16_
        return next(n for n in done["files"] if n.endswith(f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))

    model_states = load(_model_states_file(stage))
    module = model_states["module"]
    trainable = {name for names in done["groups"] for name in names}
    pieces, steps = {name: [] for name in done["tensors"]}, []
    seen = dict.fromkeys(done["tensors"], 0)  # ZeRO 1 and 2: elements of each parameter in earlier ranks' fragments
    for name in done["tensors"]:
        if name not in trainable and (stage < 3 or name in model_states["buffer_names"]):
            pieces[name].append((0, {"value": module[name].reshape(-1)}))
    if stage == 0:
        optimizer = model_states["optimizer"]
        torch_state = optimizer.get("optimizer_state_dict", optimizer)  # bf16 wraps torch's with fp32 copies
        groups = torch_state["param_groups"]
        for g, (group, names) in enumerate(zip(groups, done["groups"], strict=True)):
            for i, (index, name) in enumerate(zip(group["params"], names, strict=True)):
                value = optimizer["fp32_groups"][g][i] if "fp32_groups" in optimizer else module[name]
                state = torch_state["state"].get(index, {})  # none for a parameter that never had a gradient
                steps.append(state.get("step", 0))
                moments = {key: state[key].reshape(-1) for key in MOMENTS if key in state}
                pieces[name].append((0, {"value": value.reshape(-1), **moments}))
    for rank in range(world if stage > 0 else 0):
        saved = load(optimizer_file(rank))["optimizer_state_dict"]
        if stage < 3:
            torch_state = saved["base_optimizer_state"]
            flats, layouts = saved["single_partition_of_fp32_groups"], []
            for mapping in saved["param_slice_mappings"]:
                layouts.append([(name, address.start, address.numel) for name, address in mapping.items()])
        else:
            torch_state = saved["optimizer_state_dict"]
            flats, layouts = saved["fp32_flat_groups"], []
            for shapes in model_states["param_shapes"]:  # one ordered {name: shape} per sub-group
                layouts.append([])
                offset = 0
                for name, shape in shapes.items():
                    size = -(-math.prod(shape) // world)  # the ceiling: every rank's slice has this size
                    layouts[-1].append((name, offset, max(0, min(size, math.prod(shape) - rank * size))))
                    offset += size
            frozen = load(f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")["frozen_param_fragments"] or {}
            for name, fragment in frozen.items():
                size = fragment.numel()
                length = max(0, min(size, math.prod(done["tensors"][name]) - rank * size))
                pieces[name].append((rank * size, {"value": fragment.reshape(-1)[:length]}))
        groups = torch_state["param_groups"]
        for g, (flat, layout) in enumerate(zip(flats, layouts, strict=True)):
            state = torch_state["state"].get(g, {})
            steps.append(state.get("step", 0))
            for name, offset, length in layout:
                if stage < 3:
                    start, seen[name] = seen[name], seen[name] + length
                else:
                    start = rank * -(-math.prod(done["tensors"][name]) // world)
                tensors = {"value": flat.narrow(0, offset, length)}
                tensors.update((key, state[key].narrow(0, offset, length)) for key in MOMENTS if key in state)
                pieces[name].append((start, tensors))
    return pieces, groups, int(max(steps, default=0)), model_states


def _owned_slices(engine):
    """Each slice of a trainable parameter's flattened fp32 master weight that this rank's optimizer steps, as
    (name, start, length, master, offset): elements [start, start + length) of parameter `name` are elements
    [offset, offset + length) of the flattened tensor `master`, which also keys the optimizer's state."""
    optimizer, rank = engine.optimizer, dist.get_rank()
    names = {id(p): name for name, p in engine.module.named_parameters()}
    stage = engine.zero_optimization_stage()
    if stage in (1, 2):  # each rank steps one flat range per group; a parameter's _hp_mapping says which part
        for master, params in zip(optimizer.single_partition_of_fp32_groups, optimizer.bit16_groups, strict=True):
            for p in params:
                if p._hp_mapping is not None:  # None: no part of p lies in this rank's range
                    lp, hp = p._hp_mapping.lp_fragment_address, p._hp_mapping.hp_fragment_address
                    yield names[id(p)], lp.start, lp.numel, master, hp.start
    elif stage == 3:  # one flat partition per sub-group: each parameter's rank-th slice, in order
        for master, params in zip(optimizer.fp32_partitioned_groups_flat, optimizer.fp16_groups, strict=True):
            offset = 0
            for p in params:
                size = p.partition_numel()
                yield names[id(p)], rank * size, max(0, min(size, p.ds_numel - rank * size)), master, offset
                offset += size
    else:  # torch's optimizer steps the parameters themselves, or at bf16 an fp32 copy of each
        copies = getattr(optimizer, "fp32_groups", [g["params"] for g in optimizer.param_groups])
        lows = getattr(optimizer, "fp16_groups", copies)
        for params, masters in zip(lows, copies, strict=True):
            for p, master in zip(params, masters, strict=True):
                yield names[id(p)], 0, p.numel(), master, 0


def _write_tensor(tensor, read):
    """Write the flattened values read(start, length) gives into a module's parameter or buffer: at ZeRO 3 this
    rank's partition (and the whole tensor, where ZeRO 3 keeps a small one resident), otherwise all of it."""
    if hasattr(tensor, "ds_tensor"):  # a ZeRO 3 partition: elements [rank * size, rank * size + size)
        size = tensor.ds_tensor.numel()
        start = dist.get_rank() * size
        length = max(0, min(size, tensor.ds_numel - start))
        tensor.ds_tensor.data.view(-1).narrow(0, 0, length).copy_(read(start, length))
        if tensor.ds_status == ZeroParamStatus.AVAILABLE:
            tensor.data.view(-1).copy_(read(0, tensor.ds_numel))
    else:
        tensor.data.view(-1).copy_(read(0, tensor.numel()))


def _tensor_shapes(module) -> dict:
    """{name: shape} of a module's parameters (their full shape at ZeRO 3) and saved buffers."""
    shapes = {name: list(getattr(p, "ds_shape", p.shape)) for name, p in module.named_parameters()}
    saved = module.state_dict().keys()
    shapes.update((name, list(b.shape)) for name, b in module.named_buffers() if name in saved)
    return shapes


def _model_mismatch(done, module, ckpt_dir):
    """Why the checkpoint's model is not module's (its first differing names and shapes), else None."""
    if "tensors" not in done:  # saved by an older release
        return None
    saved, here = done["tensors"], _tensor_shapes(module)
    differing = [n for n in sorted(set(saved) | set(here)) if saved.get(n) != here.get(n)]
    if not differing:
        return None
    shown = ", ".join(f"{n}: saved {saved.get(n, 'absent')}, here {here.get(n, 'absent')}" for n in differing[:3])
    return f"checkpoint {ckpt_dir} holds another model: {len(differing)} tensors differ ({shown})"


def _damaged_record(load_dir, folder, done, rank, world_size):
    """This rank's share of checking a checkpoint's files: every world_size-th zip record (torch.save writes zip
    archives, a CRC per record, which torch.load does not verify) read and checked. (RuntimeError, why) or None."""
    ckpt_dir = os.path.join(load_dir, folder)
    records = []
    for name in sorted(n for n in done.get("files", {}) if n.endswith(".pt")):
        try:
            with zipfile.ZipFile(os.path.join(ckpt_dir, name)) as archive:
                records += [(name, info) for info in archive.infolist()]
        except (OSError, zipfile.BadZipFile) as error:
            return RuntimeError, f"checkpoint {ckpt_dir} does not load: {name} is damaged ({error})"
    problem = _damaged_among(ckpt_dir, records[rank::world_size])
    return None if problem is None else (RuntimeError, f"checkpoint {ckpt_dir} does not load: {problem}")


def _damaged_among(folder, records):
    """The first of records ((file name, zip info) pairs) whose bytes fail their CRC, and why; else None."""
    by_file = {}
    for name, info in records:
        by_file.setdefault(name, []).append(info)
    for name, infos in by_file.items():
        try:
            with zipfile.ZipFile(os.path.join(folder, name)) as archive:
                for info in infos:
                    with archive.open(info) as member:  # raises at the end of a record whose CRC differs
                        while member.read(1 << 24):
                            pass
        except (OSError, zipfile.BadZipFile) as error:
            return f"{name} is damaged ({error})"
    return None


def _written_by(name, rank) -> bool:
    """Whether this rank wrote a checkpoint file: its RNG file, its ZeRO shards, and at rank 0 the rest."""
    if name.startswith("rng_state_rank"):
        return name == RNG_FILE.format(rank=rank)
    if "zero_pp_rank_" in name:
        return f"zero_pp_rank_{rank}_" in name
    return rank == 0


def _fsync(path) -> None:
    """Make a file, or a folder's list of names, durable: flushed from the page cache to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -------------------------------------------------------------------------------------------------------------
# Small helpers


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_rng_states() -> dict:
    # Plain Python and torch types only, so load_ckpt can read them back with weights_only=True.
    states = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        states["numpy"] = (kind, keys.tolist(), pos, has_gauss, cached)
    if get_accelerator().device_name() != "cpu":
        states["device"] = get_accelerator().get_rng_state()
    return states


def _set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if numpy is not None and "numpy" in states:
        kind, keys, pos, has_gauss, cached = states["numpy"]
        numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, cached))
    if "device" in states:
        get_accelerator().set_rng_state(states["device"])


def _write_atomically(path: str, text: str) -> None:
    # A name no other process can pick: pids repeat across containers and nodes.
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=os.path.basename(path) + ".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def _complete_checkpoints(save_dir: str) -> list:
    """The complete checkpoints in save_dir, oldest first (by when they were completed)."""
    done = {n: os.path.join(save_dir, n, DONE_FILE) for n in (os.listdir(save_dir) if os.path.isdir(save_dir) else [])}
    complete = [n for n, path in done.items() if os.path.isfile(path) and not n.endswith((STAGING, REPLACED))]
    return sorted(complete, key=lambda n: (os.path.getmtime(done[n]), n))


def _read_latest(save_dir: str):
    try:
        with open(os.path.join(save_dir, "latest")) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


# -------------------------------------------------------------------------------------------------------------


def get_strategy(args) -> DeepspeedStrategy:
    """Build the strategy from a trainer's flags (an argparse.Namespace, or any object with attributes): the one
    place flags are read. A flag missing from args takes its default from the top of this file, except
    --zero_stage, which every run must choose."""
    if getattr(args, "zero_stage", None) is None:
        raise ValueError("--zero_stage is required: add parser.add_argument('--zero_stage', type=int, "
                         "choices=[0, 1, 2, 3]) and run with, for example, --zero_stage 2")  # fmt: skip
    for flag, (off, feature) in LEFT_OUT.items():
        if getattr(args, flag, off) != off:
            raise ValueError(f"--{flag} {getattr(args, flag)!r} asks for {feature}, which get_strategy.py does not "
                             f"do: leave it at {off!r}, or use OpenRLHF's own strategy")  # fmt: skip
    return DeepspeedStrategy(
        seed=getattr(args, "seed", SEED),
        full_determinism=getattr(args, "full_determinism", FULL_DETERMINISM),
        max_norm=getattr(args, "max_norm", MAX_NORM),
        micro_train_batch_size=getattr(args, "micro_train_batch_size", MICRO_TRAIN_BATCH_SIZE),
        train_batch_size=getattr(args, "train_batch_size", TRAIN_BATCH_SIZE),
        zero_stage=args.zero_stage,
        bf16=getattr(args, "bf16", BF16),
        args=args,
        adam_offload=getattr(args, "adam_offload", ADAM_OFFLOAD),
        overlap_comm=getattr(args, "overlap_comm", OVERLAP_COMM),
        grad_accum_dtype=getattr(args, "grad_accum_dtype", GRAD_ACCUM_DTYPE),
        local_rank=getattr(args, "local_rank", LOCAL_RANK),
    )
