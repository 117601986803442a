"""Tests for get_strategy.py and train_example.py, read as a specification: each test's name states a behaviour.

Run them with:  python -m pytest -q test_get_strategy.py            (the quick tier, about two minutes on 2 cores)
          and:  python -m pytest -q test_get_strategy.py -m full    (the second tier, about fifteen minutes)

Every claim is checked against an independent reference (plain single-process PyTorch, a hand computation, an
uninterrupted run, module.state_dict()) with real DeepSpeed on the CPU (gloo). Nothing here ran on a GPU: there, the
bit-exact resumes hold only with --full_determinism (SDPA's flash and memory-efficient backward passes add in a
varying order otherwise); benchmarks/gpu_check.py holds the checks for the day a GPU is lent. The two-rank cases of each tier
share one launch (of this file as the worker: python -m torch.distributed.run --nproc_per_node 2
test_get_strategy.py --worker quick|core OUT_DIR), which runs them one after another in one process group and
saves each case's results or its traceback; the tests read them. A case that needs an interpreter of its own says
why: a rank killed, a signal, a restart, a launcher, three ranks, a process traced with strace.

The quick tier, the specification of the core, establishes:
- Training: at ZeRO 0-3 in fp32, with 2 accumulation steps, clipping that bites on every step, weight-decay groups
  and a scheduler, 4 steps end within 1e-5 of plain PyTorch's weights, while they move more than 1e-3 and two
  plain-PyTorch runs that only sum the micro-batches in another order end within 1e-5 of each other.
- Resuming: at every stage, fp32 and bf16, with dropout and a shuffled loader, losses and weights are bit-identical
  to the uninterrupted run's, through the one load path. In another shape (one rank, ZeRO 2 -> 1) a load restores
  the weights, Adam's moments and step, the scheduler, the counters and the generators of random, NumPy and torch,
  reads what it wrote back through DeepSpeed's getters and refuses a layout that moved; its options leave fresh what
  they name. The corners of release 0.20.0's load: ZeRO 3 with load_optimizer_states=False loads the tag chosen, at
  every stage and dtype the next step starts from the loaded weights, a read failing on one rank raises on every
  rank naming the rank and the file; a second model's save into a save_dir and an eval engine's save are refused
  before writing; a best checkpoint left by a cut-short rotation goes with the next save; tag="latest" is named.
  Every rank resumes what it saved (release 0.21.0's last corners): at ZeRO 3 a parameter the optimizer does not
  hold, each rank's own buffers and client_state; ZeRO 2 resumed at ZeRO 3 with a group that is padding alone on a
  rank; a stale copy of a file one rank reads, a checkpoint rank 0 does not see but another does, a tag that is a
  path, a read error while checking and client_state keys of DeepSpeed's own are refused on every rank; once
  load_ckpt returns no checkpoint file stays mapped; a failed save leaves nothing on a node of its own.
- Saves in the background: save_ckpt returns before anything is written, training goes on while the write runs,
  and the load gives the state at the call to the bit; its checkpoint holds what a synchronous save's does, storage
  for storage, and loads the same objects back (a Parameter, requires_grad, one tensor under two keys, a view); one
  snapshot's buffers, reused, of the bytes per parameter the README gives, and no larger than the last save's files
  after a save with more; a write that fails on one rank raises on every rank at the next call and changes nothing;
  the flag is read from args. On 2 ranks started by hand, with a slowed disk: SIGINT during a wait for the save, then
  the emergency save a trainer makes, both committed and loading the weights at their calls; a SIGTERM handler's
  sys.exit(143) during a wait, the processes exiting 143 once the save is committed; a failed last save at exit
  making both exit 1 after the script's own exit handlers.
- Calls every rank must make: a rank waiting at save_ckpt for a rank that comes late says so, naming it, and the
  save goes on; one that never comes is named again at the timeout. Checkpoints go in the order their records say,
  whatever their files' times. prepare gives every rank rank 0's weights at every stage; without a scheduler a
  learning rate set by hand trains like plain PyTorch; prepare refuses a torch.compile()d module and, with
  adam_offload, another optimizer than DeepSpeedCPUAdam; any object with attributes serves as args. The example
  writes one JSON line per logged step, with what it printed.
- Saves that fail and damaged files: a write that fails on rank 0, rank 1 or both (a file-size limit) and a disk
  that fills (a tmpfs) make every rank raise within seconds naming the rank, the file and the free space, give the
  space back, and each leaves the previous checkpoint loadable; a truncated file, a
  damaged zip structure and a bit flipped in any kind of checkpoint file are named on every rank, and with no tag
  the next newest checkpoint resumes.
- The states of a save_dir (get_strategy.py's table): a run resumes a committed <tag>.saving and a later failed
  save of that tag keeps it; a folder that is no checkpoint, tags that cannot name one and a metric_key JSON cannot
  write are refused before anything is written; a latest that cannot be written fails the save and the load resumes
  what it said; latest set back by hand wins, saying a newer checkpoint exists; the next save finishes deletes cut
  short; a NaN metric saves without one; plain DeepSpeed checkpoints are named with the way in, never taken for a
  fresh start; save_model failing on rank 0 raises on every rank.
- Collectives match hand computation; the loader shards, skips consumed samples and, restored from a state taken
  at any point, yields what the uninterrupted one does (with workers, the order only, as documented); bad flags
  are refused before any process group, naming the flag, and so are srun's tasks of plain python; the example
  refuses bad flags before importing torch, and learns on 2 ranks.

The second tier (marked full) establishes everything else:
- The example under the deepspeed launcher (with and without --num_gpus), torchrun, plain python and two simulated
  nodes learns, its final loss the same on 1 rank as on 2; with --full_determinism it saves byte-identical weights,
  also when stopped at a step and resumed, stopped by SIGTERM to one rank (saving in the background), or restarted
  by torchrun after a rank was killed; a run stopped on 2 ranks at ZeRO 3 continues on 1 at ZeRO 2, and a full disk stops it with the
  reason until there is room; its ZeRO 3 weights load into a plain module.
- Resuming in another shape (1, 2 and 3 ranks, ZeRO 0-3, adam_offload, bf16) on a model with tied weights, a
  frozen layer, a buffer and sizes no world size divides equals plain PyTorch within 1e-5; a ZeRO 2 checkpoint
  resumes into every optimizer class DeepSpeed builds for the accepted flags; frozen layers, non-strict loads, eval
  engines, amsgrad, groups in another order refused, a plain DeepSpeed checkpoint taken in through DeepSpeed's own
  load; at 8 ranks each rank opens only its share of a checkpoint's files (strace counts every openat); adam_offload
  resumed at step 10 of 20 ends bit-identical to the uninterrupted run.
- Checkpoints under attack: a crash at every file-system operation of four saves, written by save_ckpt and again in
  the background (a kill and a power cut, traced with strace; rotation's delete and a re-save of the tag a run
  resumed from while it was <tag>.saving among them) leaves the newest committed checkpoint or the one before; a
  rank killed while saving, and one killed while its background write runs, which the other's next call names
  within seconds; a background save still writing when the script ends without teardown is committed; nodes that see
  another disk; rotation's rules (max_num, max_mem, metrics, best checkpoints, links, foreign folders, failures
  after the commit); a first save that cannot copy DeepSpeed's scripts.
- Weights and OpenRLHF's contracts: save_model and load_model at ZeRO 3 (gathered, tied, buffers, every shard, the
  ranks' weights unchanged), an Actor, moving_average, eval engines and offload, get_grad_norm equal to plain
  PyTorch's norm before clipping, DeepSpeedCPUAdam, bf16 at every stage, a model built under deepspeed.zero.Init.
- Launchers: a batch-size mismatch on independently started ranks and in each MPI launcher's world fails before any
  process group; a busy port and a missing rank are named with the fix; each MPI launcher's local rank is read;
  the README's usage block trains like plain PyTorch; every benchmark runs at its smallest setting.
"""

import argparse
import atexit
import builtins
import contextlib
import functools
import glob
import importlib.util
import inspect
import io
import itertools
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
import warnings
import zipfile
from datetime import timedelta
from functools import partial
from pathlib import Path

import deepspeed
import numpy
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

import get_strategy as get_strategy_module
from get_strategy import DONE_FILE, Checkpoints, DeepspeedStrategy, get_strategy, zip_damage
from get_strategy import _free_port as free_port
from get_strategy import saving_rank

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = sys.executable
DEEPSPEED = os.path.join(os.path.dirname(PYTHON), "deepspeed")  # the launcher script installed beside python
# Variables a launcher sets; a child process must not inherit this process's values.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK")

# The small training problem the multi-process cases share with their single-process reference.
# The first weight (HIDDEN x FEATURES = 131,072 elements) is larger than DeepSpeed's
# stage3_param_persistence_threshold (1e5 elements), so ZeRO 3 really shards it; the smaller parameters stay
# whole on every rank, as in a real model.
FEATURES, HIDDEN, OUTPUTS = 512, 256, 4
MICRO, WORLD, ACCUM = 2, 2, 2  # micro batch, ranks, accumulation steps
TRAIN = MICRO * WORLD * ACCUM  # samples per optimizer step
STEPS = 4
MAX_NORM = 0.5  # small enough that every step clips (the reference checks it)
# Adam divides by the root of the squared gradient, so an element whose gradient nearly cancels amplifies
# float rounding, less so at eps 1e-6 than 1e-8: two plain-PyTorch runs that only sum the micro-batches in
# another order end within 1e-5 at these values, while the weights move more than 1e-3 (tests show both). The
# tests compare against 1e-5.
LR, EPS, WEIGHT_DECAY, BETAS = 0.003, 1e-6, 0.1, (0.9, 0.99)


def make_model(dropout=0.0, init_seed=1234):
    torch.manual_seed(init_seed)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.LayerNorm(HIDDEN),
        torch.nn.GELU(),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(HIDDEN, OUTPUTS),
    )


def make_dataset(samples=64):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(samples, FEATURES, generator=g)
    weights = torch.randn(FEATURES, OUTPUTS, generator=g) / FEATURES**0.5  # targets of unit variance
    y = x @ weights + 0.1 * torch.randn(samples, OUTPUTS, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def lr_lambda(step):
    return 1.0 / (1.0 + step)  # a schedule that changes every step, so a scheduler stepped too often shows


def reference_optimizer(decay, no_decay, schedule):
    """Plain torch AdamW with the two groups create_optimizer makes, and a LambdaLR scheduler."""
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def reference_training(steps=STEPS, max_norm=MAX_NORM):
    """Plain single-process PyTorch computing the same global batches: returns final parameters and the
    gradient norms before clipping (max_norm 0: no clipping, as in the ds_config)."""
    model = make_model()
    decay = [model[0].weight, model[4].weight]  # named by hand: the matrices
    no_decay = [model[0].bias, model[1].weight, model[1].bias, model[4].bias]
    optimizer, scheduler = reference_optimizer(decay, no_decay, lr_lambda)
    x, y = make_dataset().tensors
    norms = []
    for step in range(steps):
        # Without shuffling, rank r's shard is samples r, r + WORLD, ...; together the ranks' micro-batches of
        # one step are the contiguous samples [step * TRAIN, (step + 1) * TRAIN).
        batch = slice(step * TRAIN, (step + 1) * TRAIN)
        optimizer.zero_grad()
        F.mse_loss(model(x[batch]), y[batch]).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or float("inf")).item())
        optimizer.step()
        scheduler.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}, norms


def started(cmd, env=None):
    """A command started from this folder, with no launcher's variables but those of env; its output is piped."""
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    clean.update(PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.Popen(cmd, cwd=HERE, env=clean, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def launch(cmd, timeout, env=None):
    """Run a command as started() does, to its end; returns (returncode, output)."""
    with started(cmd, env) as process:
        try:
            output = process.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired as expired:
            process.kill()
            expired.output = process.communicate()[0]
            raise
    return process.returncode, output


def torchrun(*args, ranks=WORLD):
    return [PYTHON, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={free_port()}", *args]


@contextlib.contextmanager
def small_disk(path):
    """A 16 MiB tmpfs mounted at path: a disk that really fills. Mounting needs root, which CI has; without it,
    path is a plain folder (os.path.ismount tells) and the cases that need a full disk skip."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16M", "tmpfs", str(path)], capture_output=True)
    try:
        yield path
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", str(path)])


def folder_bytes(path):
    """The bytes of the files in the folder path, as a checkpoint's size."""
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def read_results(out_dir, rank):
    """What run_cases saved on rank: each case's result by name, with "errors" (tracebacks by name), "seconds"
    (by name) and "finished" (whether it ran every case); no case where the rank never started."""
    folder = os.path.join(out_dir, f"rank{rank}")
    results = {"errors": {}, "seconds": {}, "finished": os.path.exists(os.path.join(folder, "finished"))}
    for path in glob.glob(os.path.join(folder, "*.pt")):
        name, saved = os.path.basename(path).removesuffix(".pt"), torch.load(path, weights_only=True)
        results["seconds"][name] = saved["seconds"]
        if "error" in saved:
            results["errors"][name] = saved["error"]
        else:
            results[name] = saved["result"]
    return results


# =============================================================================================================
# Single process: flags, validation, ds_config, seeding


@pytest.fixture(scope="session", autouse=True)
def teardown_process_group():
    """Some tests below join a one-process group inside pytest; end it cleanly before pytest exits."""
    yield
    DeepspeedStrategy(zero_stage=0).teardown()


@pytest.fixture
def clean_launch_env(monkeypatch):
    """As under plain `python`: no launcher variables. Whatever setup_distributed sets is undone afterwards."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    for name in ("CUBLAS_WORKSPACE_CONFIG", "FLASH_ATTENTION_DETERMINISTIC"):
        monkeypatch.delenv(name, raising=False)


def settings(strategy):
    """What the strategy holds for each flag get_strategy reads, by flag."""
    names = "seed full_determinism max_norm micro_train_batch_size train_batch_size bf16 adam_offload".split()
    names += ["overlap_comm", "grad_accum_dtype", "background_save", "local_rank"]
    return dict({name: getattr(strategy, name) for name in names}, zero_stage=strategy.stage)


def test_get_strategy_takes_documented_defaults_for_flags_missing_from_args():
    expected = dict(seed=42, full_determinism=False, max_norm=1.0, micro_train_batch_size=1, train_batch_size=128)
    expected.update(bf16=False, adam_offload=False, overlap_comm=False, grad_accum_dtype=None, local_rank=-1)
    expected.update(background_save=False)
    got = settings(get_strategy(argparse.Namespace(zero_stage=3)))
    assert got == dict(expected, zero_stage=3)
    assert {name: type(value) for name, value in expected.items()} == {name: type(got[name]) for name in expected}


def test_get_strategy_reads_every_flag_from_args():
    flags = dict(seed=7, full_determinism=True, max_norm=0.0, micro_train_batch_size=4, train_batch_size=64)
    flags.update(zero_stage=1, bf16=True, adam_offload=True, overlap_comm=True, grad_accum_dtype="fp32", local_rank=0)
    flags.update(background_save=True)
    args = argparse.Namespace(**flags, learning_rate=3e-4)
    strategy = get_strategy(args)
    assert settings(strategy) == flags
    assert strategy.args is args  # the trainer's other flags stay reachable


def test_any_object_with_the_flags_as_attributes_serves_as_args():
    class Flags:  # no argparse at all
        zero_stage, micro_train_batch_size, train_batch_size = 3, 4, 64

    for args in (Flags(), types.SimpleNamespace(zero_stage=3, micro_train_batch_size=4, train_batch_size=64)):
        strategy = get_strategy(args)
        assert (strategy.stage, strategy.micro_train_batch_size, strategy.train_batch_size) == (3, 4, 64)
        assert strategy.max_norm == 1.0  # the flags it lacks take their defaults


def test_get_strategy_requires_zero_stage():
    with pytest.raises(ValueError, match="--zero_stage is required"):
        get_strategy(argparse.Namespace(train_batch_size=8))


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(zero_stage=4), "--zero_stage"),
        (dict(zero_stage=-1), "--zero_stage"),
        (dict(zero_stage="2"), "--zero_stage"),
        (dict(zero_stage=True), "--zero_stage"),
        (dict(zero_stage=1.0), "--zero_stage"),
        (dict(bf16="false"), "--bf16"),
        (dict(full_determinism=1), "--full_determinism"),
        (dict(adam_offload=None), "--adam_offload"),
        (dict(overlap_comm="yes"), "--overlap_comm"),
        (dict(background_save=1), "--background_save"),
        (dict(micro_train_batch_size=0), "--micro_train_batch_size"),
        (dict(micro_train_batch_size=1.5), "--micro_train_batch_size"),
        (dict(train_batch_size=0), "--train_batch_size"),
        (dict(max_norm=-0.1), "--max_norm"),
        (dict(max_norm=float("nan")), "--max_norm"),
        (dict(max_norm="1.0"), "--max_norm"),
        (dict(seed="42"), "--seed"),
        (dict(grad_accum_dtype="float32"), "--grad_accum_dtype"),
        (dict(zero_stage=0, bf16=True, grad_accum_dtype="fp32"), "--grad_accum_dtype"),
        (dict(zero_stage=0, adam_offload=True), "--adam_offload"),
        (dict(local_rank=-2), "--local_rank"),
    ],
)
def test_invalid_value_raises_value_error_naming_its_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        DeepspeedStrategy(**{"zero_stage": 2, **kwargs})


def test_max_norm_zero_is_valid_and_turns_clipping_off():
    assert DeepspeedStrategy(max_norm=0, zero_stage=2).get_ds_train_config()["gradient_clipping"] == 0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_train_config_for_each_stage(stage):
    strategy = DeepspeedStrategy(max_norm=0.5, micro_train_batch_size=2, train_batch_size=16, zero_stage=stage)
    expected = {
        "train_micro_batch_size_per_gpu": 2,
        "train_batch_size": 16,
        "gradient_clipping": 0.5,
        "zero_optimization": {
            "stage": stage,
            "offload_optimizer": {"device": "none", "pin_memory": True},
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "bf16": {"enabled": False},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    config = strategy.get_ds_train_config()
    assert config == expected
    assert json.loads(json.dumps(config)) == expected  # plain JSON, as a ds_config file would hold


def test_train_config_with_every_option_on():
    options = dict(bf16=True, adam_offload=True, overlap_comm=True, grad_accum_dtype="fp32")
    strategy = DeepspeedStrategy(max_norm=1.0, micro_train_batch_size=1, train_batch_size=8, zero_stage=3, **options)
    assert strategy.get_ds_train_config(is_actor=True) == {
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": 8,
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "stage3_gather_16bit_weights_on_model_save": True,
            "overlap_comm": True,
        },
        "bf16": {"enabled": True},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "data_types": {"grad_accum_dtype": "fp32"},
    }


@pytest.mark.parametrize("stage, eval_stage", [(0, 0), (1, 0), (2, 0), (3, 3)])
def test_eval_config_shards_weights_only_when_training_uses_zero_3(stage, eval_stage):
    strategy = DeepspeedStrategy(micro_train_batch_size=2, train_batch_size=16, zero_stage=stage, bf16=True)
    expected_zero = {"stage": eval_stage, "stage3_gather_16bit_weights_on_model_save": True}
    if stage == 3:
        expected_zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    assert strategy.get_ds_eval_config(offload=True) == {
        "train_micro_batch_size_per_gpu": 2,
        "train_batch_size": 16,
        "zero_optimization": expected_zero,
        "bf16": {"enabled": True},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def test_create_optimizer_decays_matrices_but_not_biases_or_norm_weights():
    model = make_model()
    optimizer = DeepspeedStrategy(zero_stage=2).create_optimizer(model, lr=1e-3, weight_decay=0.1)
    assert isinstance(optimizer, torch.optim.AdamW)  # on CPU without --adam_offload
    named = {id(p): name for name, p in model.named_parameters()}
    groups = [({named[id(p)] for p in g["params"]}, g["weight_decay"]) for g in optimizer.param_groups]
    assert groups == [({"0.weight", "4.weight"}, 0.1), ({"0.bias", "1.weight", "1.bias", "4.bias"}, 0.0)]


def test_usage_from_the_docstring_runs_under_plain_python(clean_launch_env):
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero_stage", type=int)
    parser.add_argument("--micro_train_batch_size", type=int)
    parser.add_argument("--train_batch_size", type=int)
    args = parser.parse_args(["--zero_stage", "2", "--micro_train_batch_size", "2", "--train_batch_size", "8"])
    strategy = get_strategy(args)
    strategy.setup_distributed()
    assert (strategy.world_size, strategy.accumulated_gradient) == (1, 4)  # 8 = 2 * 1 * 4
    assert (strategy.get_rank(), strategy.is_rank_0()) == (0, True)


def test_setup_distributed_twice_reseeds_and_draws_the_same_numbers(clean_launch_env):
    strategy = get_strategy(argparse.Namespace(zero_stage=0, seed=7, train_batch_size=4))

    def draw():
        strategy.setup_distributed()
        return random.random(), numpy.random.rand(), torch.rand(3)

    first, second = draw(), draw()
    assert first[:2] == second[:2] and torch.equal(first[2], second[2])
    other = get_strategy(argparse.Namespace(zero_stage=0, seed=8, train_batch_size=4))
    other.setup_distributed()
    assert torch.rand(3).tolist() != first[2].tolist()


def test_batch_size_not_divisible_fails_before_any_process_group(clean_launch_env):
    strategy = get_strategy(argparse.Namespace(zero_stage=2, micro_train_batch_size=2, train_batch_size=5))
    with pytest.raises(ValueError, match=r"--train_batch_size 5 must be a multiple of .* = 2 \(try 4 or 6\)"):
        strategy.setup_distributed()


def test_tasks_srun_started_as_plain_python_are_refused_naming_srun_instead_of_training_alone(
    clean_launch_env, monkeypatch
):
    """srun sets SLURM's variables and none of a launcher's: each task would be a world of one."""
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "2")
    strategy = get_strategy(argparse.Namespace(zero_stage=2, micro_train_batch_size=1, train_batch_size=4))
    with pytest.raises(ValueError, match="srun started 4 tasks of plain python, each a world of one: .* torchrun"):
        strategy.setup_distributed()


def test_full_determinism_turns_on_torch_and_library_switches(clean_launch_env):
    strategy = get_strategy(argparse.Namespace(zero_stage=0, full_determinism=True, train_batch_size=1))
    try:
        strategy.setup_distributed()
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert os.environ["FLASH_ATTENTION_DETERMINISTIC"] == "1"
        assert not torch.utils.deterministic.fill_uninitialized_memory  # DeepSpeed's buckets are not NaN-filled
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
        torch.utils.deterministic.fill_uninitialized_memory = True


def test_load_model_refuses_a_file_that_carries_code(tmp_path):
    marker = tmp_path / "payload_ran"
    path = tmp_path / "evil.bin"
    torch.save({"0.weight": torch.zeros(HIDDEN, FEATURES), "extra": Payload(str(marker))}, path)
    with pytest.raises(ValueError, match="refusing to load .*evil.bin"):
        DeepspeedStrategy(zero_stage=0).load_model(make_model(), str(path))
    assert not marker.exists()


def test_load_model_refuses_a_file_with_a_flipped_bit_naming_it(tmp_path):
    path = tmp_path / "w.bin"
    torch.save(make_model().state_dict(), path)
    flip_a_bit_in_the_largest_tensor(path)
    with pytest.raises(ValueError, match=r"refusing to load: .*w.bin is damaged \(Bad CRC-32"):
        DeepspeedStrategy(zero_stage=0).load_model(make_model(), str(path))


def test_calls_made_too_early_or_with_a_bad_value_say_what_to_do(tmp_path):
    strategy = DeepspeedStrategy(zero_stage=2)
    with pytest.raises(RuntimeError, match=r"call strategy.setup_distributed\(\) before strategy.prepare\(\)"):
        strategy.prepare(make_model())
    for call, data in (("all_reduce", 1.0), ("all_gather", {"loss": torch.ones(1)})):
        with pytest.raises(RuntimeError, match=rf"call strategy.setup_distributed\(\) before strategy.{call}\(\)"):
            getattr(strategy, call)(data)
    with pytest.raises(ValueError, match="save_ckpt max_num 0 must be a whole number >= 1"):
        strategy.save_ckpt(None, str(tmp_path), max_num=0)
    for max_mem in ("5", 0, float("nan"), True):  # rank 0 alone would have failed at rotation, after its commit
        with pytest.raises(ValueError, match=rf"save_ckpt max_mem {max_mem!r} must be a number of GiB > 0"):
            strategy.save_ckpt(None, str(tmp_path), max_mem=max_mem)
    assert os.listdir(tmp_path) == []


def test_load_model_reads_a_state_dict_into_a_plain_module(tmp_path):
    source, target = make_model(init_seed=1), make_model(init_seed=2)
    torch.save({"layer." + k: v for k, v in source.state_dict().items()}, tmp_path / "w.bin")
    strip = lambda sd: {k.removeprefix("layer."): v for k, v in sd.items()}  # noqa: E731
    DeepspeedStrategy(zero_stage=0).load_model(target, str(tmp_path / "w.bin"), strict=True, key_replace_fn=strip)
    assert all(
        torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values(), strict=True)
    )


# OpenRLHF's flags for features get_strategy.py leaves out: (a value that asks for one, the parser's default).
LEFT_OUT = dict(ring_attn_size=(2, 1), ds_tensor_parallel_size=(2, 1), zpg=(8, 1))
LEFT_OUT.update(use_ds_universal_ckpt=(True, False), deepcompile=(True, False))


@pytest.mark.parametrize("flag", LEFT_OUT)
def test_an_openrlhf_flag_for_a_left_out_feature_is_refused_unless_off(flag):
    value, off = LEFT_OUT[flag]
    with pytest.raises(ValueError, match=f"--{flag} {value!r} asks for .* which get_strategy.py does not do"):
        get_strategy(argparse.Namespace(zero_stage=2, **{flag: value}))
    get_strategy(argparse.Namespace(zero_stage=2, **{flag: off}))  # OpenRLHF's parser defaults pass


def test_param_dtype_bf16_of_openrlhf_0_9_2_turns_bf16_on_and_prepare_makes_bfloat16_weights(clean_launch_env):
    # A parser that still has --bf16 leaves it False unless given: param_dtype decides.
    assert get_strategy(argparse.Namespace(zero_stage=2, bf16=False, param_dtype="bf16")).bf16 is True
    strategy = get_strategy(argparse.Namespace(zero_stage=2, param_dtype="bf16", train_batch_size=1))
    assert strategy.get_ds_train_config()["bf16"] == {"enabled": True}
    strategy.setup_distributed()
    model = torch.nn.Linear(4, 2)
    engine, _, _ = strategy.prepare((model, strategy.create_optimizer(model, lr=1e-3), None))
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(param_dtype="fp16"), r"--param_dtype 'fp16' must be bf16, .*fp16 is not supported: DeepSpeed's fp16"),
        (dict(param_dtype="fp32"), r"--param_dtype 'fp32' must be bf16, or left out for fp32"),
        (dict(bf16=True, param_dtype="fp16"), r"--param_dtype 'fp16' must be bf16"),
    ],
)
def test_a_param_dtype_other_than_bf16_is_refused_before_any_work_naming_the_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        get_strategy(argparse.Namespace(zero_stage=2, **flags))


def test_openrlhf_0_10_2s_nested_args_are_refused_naming_the_release_boundary():
    args = types.SimpleNamespace(ds=types.SimpleNamespace(zero_stage=2, param_dtype="bf16"))  # hierarchize's shape
    with pytest.raises(ValueError, match=r"OpenRLHF 0\.10\.2 .*args\.ds\.zero_stage.* up to OpenRLHF 0\.10\.1"):
        get_strategy(args)


@pytest.mark.full
def test_num_workers_loads_the_same_batches_in_the_same_order_in_worker_processes():
    strategy = get_strategy(argparse.Namespace(zero_stage=0))
    dataset = torch.utils.data.TensorDataset(torch.arange(20))
    in_workers = strategy.setup_dataloader(dataset, 2, num_workers=2)
    assert in_workers.num_workers == 2
    in_main = strategy.setup_dataloader(dataset, 2)
    assert [batch.tolist() for (batch,) in in_workers] == [batch.tolist() for (batch,) in in_main]


class Draws(torch.utils.data.Dataset):
    """Each sample its index and one random number drawn as it loads, as an augmentation draws."""

    def __len__(self):
        return 16

    def __getitem__(self, index):
        return torch.tensor([float(index), torch.rand(()).item()])


def test_a_restored_loader_keeps_the_order_and_without_workers_a_random_datasets_draws_too():
    """What setup_dataloader's docstring and the README claim: with num_workers > 0 only the order is kept (torch
    seeds each worker once per pass, and batch i goes to worker i % num_workers); without workers the draws come
    from the generator load_ckpt restores, here restored by hand."""
    strategy, kept = get_strategy(argparse.Namespace(zero_stage=0)), {}
    for workers in (0, 2):
        torch.manual_seed(0)
        loader = strategy.setup_dataloader(Draws(), 2, num_workers=workers)
        batches = iter(loader)
        next(batches), next(batches)
        state, generator = loader.state_dict(), torch.get_rng_state()
        uninterrupted = list(batches)
        restored = strategy.setup_dataloader(Draws(), 2, num_workers=workers)
        restored.load_state_dict(state)
        torch.set_rng_state(generator)
        resumed = list(restored)
        order = [batch[:, 0].tolist() for batch in resumed] == [batch[:, 0].tolist() for batch in uninterrupted]
        kept[workers] = (order, all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted, strict=True)))
    assert kept == {0: (True, True), 2: (True, False)}


def loader_round_trips(strategy, samples, shuffle, set_epoch, consumed_samples, passes=3):
    """(trips, epochs) of the strategy's loaders of `samples` samples in batches of 2. For every moment a trainer
    can take a loader's state_dict() (before the first batch, after each batch, after each pass): the batches the
    loader yields after it, to the end of `passes` passes, and the batches a new loader yields once given that state
    (through JSON: plain data). And the batches of each pass. The trainer calls set_epoch(epoch) before each pass it
    starts, or never; a resumed trainer goes on with the pass its state was taken in. A batch is the list of its
    sample indices."""
    dataset = torch.utils.data.TensorDataset(torch.arange(samples))
    make_loader = partial(strategy.setup_dataloader, dataset, 2, shuffle=shuffle, consumed_samples=consumed_samples)
    loader, seen, epochs = make_loader(), [], []
    states = [(0, 0, json.dumps(loader.state_dict()))]  # (batches seen, the pass to resume with, the state)
    for epoch in range(passes):
        if set_epoch:
            loader.sampler.set_epoch(epoch)
        epochs.append([])
        for (batch,) in loader:
            seen.append(batch.tolist())
            epochs[-1].append(batch.tolist())
            states.append((len(seen), epoch, json.dumps(loader.state_dict())))
        states.append((len(seen), epoch + 1, json.dumps(loader.state_dict())))  # the pass has ended
    trips = []
    for k, resumed_epoch, state in states:
        restored, resumed = make_loader(), []
        restored.load_state_dict(json.loads(state))
        for epoch in range(resumed_epoch, passes):
            if set_epoch and epoch > resumed_epoch:  # the pass the state was taken in goes on without one
                restored.sampler.set_epoch(epoch)
            resumed += [batch.tolist() for (batch,) in restored]
        trips.append((seen[k:], resumed))
    return trips, epochs


# (shuffle, set_epoch, consumed_samples the loader is set up with)
ROUND_TRIPS = [(True, True, 0), (True, False, 0), (False, False, 0), (True, False, 4)]


@pytest.fixture(scope="module")
def loader_alone(tmp_path_factory):
    """The round trips of run_loader_alone: a process that never joins a process group, as PPO's driver, which
    builds its prompts loader before any exists (this pytest process has one, which DeepSpeed keeps using)."""
    out = tmp_path_factory.mktemp("loader_alone")
    returncode, output = launch([PYTHON, "test_get_strategy.py", "--worker", "loader_alone", str(out)], 120)
    assert returncode == 0, output[-5000:]
    return torch.load(out / "results.pt", weights_only=True)


def run_loader_alone(out_dir):
    strategy = get_strategy(argparse.Namespace(zero_stage=0))
    results = {trip: loader_round_trips(strategy, 10, *trip) for trip in ROUND_TRIPS}
    torch.save(results, os.path.join(out_dir, "results.pt"))


@pytest.mark.parametrize("shuffle, set_epoch, consumed_samples", ROUND_TRIPS)
def test_without_a_process_group_a_loader_restored_from_any_state_yields_what_the_uninterrupted_one_does(
    loader_alone, shuffle, set_epoch, consumed_samples
):
    trips, epochs = loader_alone[shuffle, set_epoch, consumed_samples]
    assert len(trips) == 1 + sum(len(epoch) for epoch in epochs) + 3  # before, after each batch, after each pass
    for after, resumed in trips:
        assert resumed == after
    passes = [[i for batch in epoch for i in batch] for epoch in epochs]
    for samples in passes[1:]:  # the whole dataset in every whole pass: a world of one
        assert sorted(samples) == list(range(10))
    assert (passes[1] != list(range(10))) == shuffle  # shuffled, or in order
    assert (passes[1] != passes[2]) == shuffle  # shuffled anew each epoch
    assert len(passes[0]) == 10 - consumed_samples  # the first pass skips the consumed samples


class Actor(torch.nn.Module):
    """OpenRLHF's Actor contract: the trained model lives in `.model`; the wrapper has no weights of its own."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)


class HuggingFaceLike(torch.nn.Module):
    """A causal LM as transformers lays it out: a backbone in `.model`, a head beside it, save_pretrained."""

    def __init__(self, tied=False):
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8))
        self.lm_head = torch.nn.Linear(8, 16, bias=False)
        if tied:  # then every weight is inside the backbone, as in a model with tied embeddings
            self.lm_head.weight = self.model[0].weight

    def save_pretrained(self, directory, state_dict=None):
        torch.save(state_dict, os.path.join(directory, "model.bin"))


def test_an_actor_is_unwrapped_but_a_hugging_face_models_backbone_is_not():
    engine_behind = get_strategy_module.engine_of
    inner = make_model()
    assert engine_behind(Actor(inner)) is inner
    for model in (HuggingFaceLike(), HuggingFaceLike(tied=True)):
        assert engine_behind(model) is model
    with_head = Actor(make_model())
    with_head.head = torch.nn.Linear(2, 2)  # weights of its own: a model that happens to name a part `model`
    assert engine_behind(with_head) is with_head
    assert DeepspeedStrategy(zero_stage=2)._unwrap_model(Actor(inner)) is inner


def test_load_model_refuses_a_file_none_of_whose_keys_the_model_has(tmp_path):
    torch.save({"model." + k: v for k, v in make_model().state_dict().items()}, tmp_path / "prefixed.bin")
    with pytest.raises(ValueError, match=r"none of the 6 keys in .*prefixed.bin is a key of the model"):
        DeepspeedStrategy(zero_stage=0).load_model(make_model(), str(tmp_path / "prefixed.bin"))  # strict=False


def test_load_model_reports_missing_and_unexpected_keys(tmp_path, capsys):
    state = make_model(init_seed=1).state_dict()
    state["extra.weight"] = state.pop("4.bias")
    torch.save(state, tmp_path / "partial.bin")
    target = make_model(init_seed=2)
    DeepspeedStrategy(zero_stage=0).load_model(target, str(tmp_path / "partial.bin"))
    assert "1 missing keys ['4.bias'] and 1 unexpected keys ['extra.weight']" in capsys.readouterr().out
    assert torch.equal(target[0].weight, state["0.weight"])  # what matched did load


@pytest.mark.full
@pytest.mark.parametrize("launcher", ["Open MPI", "MVAPICH", "MPICH, Intel MPI"])
def test_local_rank_comes_from_an_mpi_launchers_variables(clean_launch_env, monkeypatch, launcher):
    # As after mpirun and DeepSpeed's discovery of the ranks (mpi4py's, which needs an MPI installation): a process
    # group, the launcher's variables, no LOCAL_RANK of torch's.
    get_strategy(argparse.Namespace(zero_stage=0, train_batch_size=1)).setup_distributed()
    monkeypatch.delenv("LOCAL_RANK")
    for name, value in zip(MPI_VARS[launcher], ("1", "0", "1")):
        monkeypatch.setenv(name, value)
    for name, value in (
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(free_port())),
    ):
        monkeypatch.setenv(name, value)
    strategy = get_strategy(argparse.Namespace(zero_stage=0, train_batch_size=1))
    strategy.setup_distributed()
    assert strategy.local_rank == 1


def test_the_ranks_shares_of_the_crc_check_cover_every_record_once(tmp_path):
    """A bit flipped in any one record of a file is found by exactly one rank, whatever the world size."""
    torch.save({f"t{i}": torch.randn(64 + i) for i in range(5)}, tmp_path / "b.pt")
    with zipfile.ZipFile(tmp_path / "b.pt") as archive:
        records = [info for info in archive.infolist() if "/data/" in info.filename]
    for record in records:
        damaged = tmp_path / "damaged.pt"
        damaged.write_bytes((tmp_path / "b.pt").read_bytes())
        flip_a_bit_in_the_largest_tensor(damaged, record)
        for world_size in (1, 2, 3, 7):
            found = [zip_damage(str(damaged), None, r, world_size) for r in range(world_size)]
            assert sum(f is not None for f in found) == 1, (record.filename, world_size, found)
            assert "damaged.pt is damaged (Bad CRC-32" in next(f for f in found if f)


def test_the_ranks_share_the_crc_check_so_each_huge_record_goes_to_another_rank(tmp_path, monkeypatch):
    """A file of two huge records and a few small ones (load_model's at ZeRO 3, where the ranks share its check):
    shared by count in the file's order, both huge records could fall to one rank, which would read almost every
    byte."""
    tensors = {"huge_a": torch.randn(100_000), **{f"small{i}": torch.randn(8) for i in range(3)}}
    torch.save({**tensors, "huge_b": torch.randn(100_000)}, tmp_path / "a.pt")
    read, crc32 = [], zipfile.crc32
    monkeypatch.setattr(zipfile, "crc32", lambda data, *a: read.append(len(data)) or crc32(data, *a))
    shares = []
    for rank in range(2):
        read.clear()
        assert zip_damage(str(tmp_path / "a.pt"), None, rank, 2) is None
        shares.append(sum(read))
    assert min(shares) > 0.4 * sum(shares), shares  # each rank about half: one huge record each


def test_damage_to_the_zip_structure_of_a_file_is_named_by_the_crc_check_never_raised(tmp_path):
    """Bytes torch.save's zip writer puts around the tensors, damaged: the largest record's compression method or
    compressed size in the central directory, or its local header's extra-field length. Each is named as damage
    (and load_ckpt falls back to an older checkpoint), not raised from zipfile (which would leave the other ranks
    waiting), whichever rank's share holds the record."""
    torch.save({f"t{i}": torch.randn(256) for i in range(3)}, tmp_path / "a.pt")
    data = (tmp_path / "a.pt").read_bytes()
    with zipfile.ZipFile(tmp_path / "a.pt") as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    # Its entry in the central directory: the signature PK\1\2, then fixed fields, the name at byte 46.
    central = data.index(b"PK\x01\x02")
    while data[central + 46 : central + 46 + len(info.filename)] != info.filename.encode():
        central = data.index(b"PK\x01\x02", central + 4)
    damages = {  # (offset, new little-endian bytes)
        "compression method stored -> 1": (central + 10, (1).to_bytes(2, "little")),
        "compression method stored -> deflate": (central + 10, (8).to_bytes(2, "little")),
        "compressed size + 1": (central + 20, (info.compress_size + 1).to_bytes(4, "little")),
        "local extra-field length + 4096": (
            info.header_offset + 28,
            (4096 + data[info.header_offset + 28]).to_bytes(2, "little"),
        ),
    }
    for what, (offset, value) in damages.items():
        (tmp_path / "b.pt").write_bytes(data[:offset] + value + data[offset + len(value) :])
        found = [zip_damage(str(tmp_path / "b.pt"), None, r, 2) for r in range(2)]
        assert any(f and "b.pt is damaged" in f for f in found), (what, found)


def test_a_complete_saving_folder_stands_for_its_tag_and_working_folders_are_no_checkpoints(tmp_path):
    """A crash after a save's record, before its rename, leaves <tag>.saving complete: it is <tag>, the newer one.
    A <name>.deleting is on its way out, record or not; a <tag>.saving without a record is a save cut short."""
    strategy = DeepspeedStrategy(zero_stage=2)
    for when, name in enumerate(["A", "B", "B.saving", "D.deleting", "E.saving"]):
        (tmp_path / name).mkdir()
        if name != "E.saving":
            (tmp_path / name / "checkpoint_complete.json").write_text("{}")
            os.utime(tmp_path / name / "checkpoint_complete.json", (1000 + when, 1000 + when))
    assert Checkpoints(strategy, None)._checkpoints(str(tmp_path)) == {"A": "A", "B": "B.saving"}


# =============================================================================================================
# One process: a rank of its own for load_ckpt's options, the generators, tags, Adam's step of a parameter no
# loss reaches, the eval engine's offload and the preemption signals; and the pieces that need no process group.


def test_load_model_refuses_a_tensor_whose_shape_differs_from_the_models_though_its_size_matches(tmp_path):
    model = torch.nn.Linear(4, 8)  # weight (8, 4)
    state_dict = {key: value.clone() for key, value in model.state_dict().items()}
    state_dict["weight"] = state_dict["weight"].T.contiguous()  # (4, 8): the same 32 elements, transposed
    torch.save(state_dict, tmp_path / "transposed.pt")
    before = model.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"weight has shape \(4, 8\), the model's \(8, 4\)"):
        DeepspeedStrategy(zero_stage=0).load_model(model, str(tmp_path / "transposed.pt"))
    assert torch.equal(model.weight, before)


def test_set_seed_seeds_random_numpy_and_torch_with_the_given_seed():
    DeepspeedStrategy(zero_stage=0).set_seed(123)
    drawn = random.random(), numpy.random.rand(), torch.rand(3)
    assert drawn[0] == random.Random(123).random()
    assert drawn[1] == numpy.random.RandomState(123).rand()
    assert torch.equal(drawn[2], torch.rand(3, generator=torch.Generator().manual_seed(123)))


def test_without_set_epoch_each_pass_is_the_next_epoch_in_the_order_the_strategys_seed_gives():
    dataset = torch.utils.data.TensorDataset(torch.arange(20))
    for seed in (7, 8):
        loader = get_strategy(argparse.Namespace(zero_stage=0, seed=seed)).setup_dataloader(dataset, 4)
        passes = [[i for (batch,) in loader for i in batch.tolist()] for _ in range(3)]
        # torch's DistributedSampler on one rank: epoch e is randperm under the seed seed + e.
        expected = [torch.randperm(20, generator=torch.Generator().manual_seed(seed + e)).tolist() for e in range(3)]
        assert passes == expected


def test_consumed_samples_skips_into_the_first_pass_only_and_a_whole_epoch_leaves_that_pass_empty():
    dataset = torch.utils.data.TensorDataset(torch.arange(20))
    strategy = get_strategy(argparse.Namespace(zero_stage=0, seed=7))
    epoch = [torch.randperm(20, generator=torch.Generator().manual_seed(7 + e)).tolist() for e in range(2)]
    for consumed, first_pass in ((8, epoch[0][8:]), (20, []), (28, [])):
        loader = strategy.setup_dataloader(dataset, 4, consumed_samples=consumed)
        assert [i for (batch,) in loader for i in batch.tolist()] == first_pass
        assert [i for (batch,) in loader for i in batch.tolist()] == epoch[1]  # the next pass: all of epoch 1


def test_plain_pytorch_runs_that_only_sum_the_micro_batches_in_another_order_agree_within_the_tolerance():
    """Why the training tests compare with 1e-5: two plain-PyTorch runs of the reference's 4 steps that only sum
    each step's micro-batches in another order end that close, not closer than float rounding allows."""

    def run(reverse):
        model = make_model()
        decay, no_decay = [model[0].weight, model[4].weight], [model[0].bias, model[1].weight, model[1].bias]
        optimizer, scheduler = reference_optimizer(decay, no_decay + [model[4].bias], lr_lambda)
        x, y = make_dataset().tensors
        for step in range(STEPS):
            optimizer.zero_grad()
            starts = list(range(step * TRAIN, (step + 1) * TRAIN, MICRO))
            for start in reversed(starts) if reverse else starts:
                micro = slice(start, start + MICRO)
                (F.mse_loss(model(x[micro]), y[micro]) / len(starts)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            scheduler.step()
        return dict(model.named_parameters())

    ahead, back = run(False), run(True)
    difference = max((ahead[name] - back[name]).abs().max().item() for name in ahead)
    print(f"two plain-PyTorch runs, micro-batches summed in either order: {difference:.1e} apart")
    assert 0 < difference < 1e-5


def test_all_reduce_refuses_an_op_it_does_not_implement_instead_of_summing(clean_launch_env):
    strategy = get_strategy(argparse.Namespace(zero_stage=0, train_batch_size=1))
    strategy.setup_distributed()
    with pytest.raises(ValueError, match="all_reduce op 'min' must be 'mean', 'max' or 'sum'"):
        strategy.all_reduce(torch.tensor([1.0, 2.0]), "min")


@pytest.mark.full
@pytest.mark.full
def test_a_frozen_model_marked_offload_becomes_an_eval_engine_whose_weights_deepspeed_keeps_in_cpu_memory(
    clean_launch_env,
):
    strategy = new_strategy(3)
    marked, unmarked = make_model(), make_model()
    marked._offload = True  # OpenRLHF's mark on a reference or reward model
    engines = strategy.prepare(marked, unmarked)
    assert engines[0].zero_offload_param().device == "cpu"  # the config DeepSpeed's engine runs with
    assert engines[1].zero_offload_param() is None


def draws():
    """One number from each generator a training step may draw from: Python's random, NumPy's and torch's."""
    return random.random(), numpy.random.rand(), torch.rand(1).item()


def engine_state(engine, scheduler):
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    steps = {float(state["step"]) for state in base.state.values() if "step" in state}
    state = dict(params=full_params(engine), optimizer=optimizer_snapshot(engine), steps=steps)
    return dict(state, scheduler_steps=scheduler.last_epoch, global_steps=engine.global_steps)


OPTIONS = dict(everything={}, module_only={"load_module_only": True})  # what each load passes to load_ckpt
OPTIONS.update(no_optimizer={"load_optimizer_states": False}, no_scheduler={"load_lr_scheduler_states": False})
# What an engine fresh from prepare() holds: no Adam state and no step yet, its scheduler and counters at 0.
FRESH = dict(moments=False, steps=set(), scheduler_steps=0, global_steps=0)


@pytest.fixture(scope="module")
def one_rank_loads(tmp_path_factory):
    """One rank in this process: ZeRO 2 trained 2 steps and saved; then fresh engines (other initial weights) at
    ZeRO 2 (the same shape; a full load is tested at every stage elsewhere) and at ZeRO 1 (another shape) load it
    with OPTIONS, and the generators are drawn from right after the save and after each load. Also checkpoints
    under the tags 0 and 7."""
    out = tmp_path_factory.mktemp("one_rank_loads")
    ckpt, tags = str(out / "ckpt"), str(out / "tags")
    results = {}
    with in_this_process():
        strategy = new_strategy(2)
        engine, optimizer, scheduler = prepared(strategy)
        train(strategy, engine, optimizer, scheduler, strategy.setup_dataloader(make_dataset(), MICRO), 2)
        DeepspeedStrategy(zero_stage=0).set_seed(2024)  # generators where no setup_distributed leaves them
        strategy.save_ckpt(engine, ckpt)
        results["saved"] = dict(draws=draws(), **engine_state(engine, scheduler))
        for tag in (0, 7):  # 7 is latest's
            strategy.save_ckpt(engine, tags, tag=tag, client_state={"saved_as": tag})
        results["tag_0"] = strategy.load_ckpt(engine, tags, tag=0)[1]["saved_as"]
        for stage in (2, 1):
            strategy = new_strategy(stage)
            for option, kwargs in OPTIONS.items():
                if (stage, option) != (2, "everything"):
                    engine, optimizer, scheduler = prepared(strategy, init_seed=999)
                    made, zeros_like = [], torch.zeros_like  # the tensors get_strategy.py's zeros_like makes

                    def counted_zeros_like(*args, **kwargs):
                        if sys._getframe(1).f_code.co_filename.endswith("get_strategy.py"):  # not DeepSpeed's getters
                            made.append(args[0].numel())
                        return zeros_like(*args, **kwargs)

                    with pytest.MonkeyPatch.context() as monkeypatch:
                        monkeypatch.setattr(torch, "zeros_like", counted_zeros_like)
                        strategy.load_ckpt(engine, ckpt, **kwargs)
                    results[stage, option] = dict(draws=draws(), **engine_state(engine, scheduler))
                    masters = len(optimizer.single_partition_of_fp32_groups)
                    results[stage, option].update(zeros_made=len(made), masters=masters)
        # A DeepSpeed whose private layout moved, as the reader would meet it: each fragment one element off.
        from get_strategy import ReshapingReader

        fragments, verify, seconds = ReshapingReader.owned_fragments, ReshapingReader.verify, []

        def shifted(reader):
            for (name, start, offset, length), master in fragments(reader):
                yield get_strategy_module.Fragment(name, start + 1, offset, length - 1), master  # inside the tensor

        def timed(reader, *args):
            start = time.perf_counter()
            try:
                return verify(reader, *args)
            finally:
                seconds.append(time.perf_counter() - start)

        engine, optimizer, scheduler = prepared(strategy, init_seed=999)
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.setattr(ReshapingReader, "verify", timed)
            start = time.perf_counter()
            strategy.load_ckpt(engine, ckpt)
            results["verify_seconds"], results["load_seconds"] = seconds[-1], time.perf_counter() - start
            monkeypatch.setattr(ReshapingReader, "owned_fragments", shifted)
            results["layout_moved"] = error_of(strategy.load_ckpt, engine, ckpt)
        modes = {name: os.stat(os.path.join(tags, name)).st_mode & 0o777 for name in ("latest", "7/" + DONE_FILE)}
        (out / "plain_file").touch()
        results["modes"], results["plain_mode"] = modes, os.stat(out / "plain_file").st_mode & 0o777
    return results


def test_latest_and_the_record_are_as_readable_as_any_file_this_process_writes(one_rank_loads):
    """Another user sharing save_dir must be able to resume (0.17's mkstemp made them its owner's alone)."""
    assert one_rank_loads["modes"] == dict.fromkeys(("latest", "7/" + DONE_FILE), one_rank_loads["plain_mode"])


def test_a_load_reads_back_through_deepspeeds_getters_and_refuses_a_layout_that_moved(one_rank_loads):
    """The reader writes DeepSpeed's private layouts; DeepSpeed's public getters check a sample of what it wrote.
    The check costs little next to the load (printed)."""
    error = one_rank_loads["layout_moved"]
    assert error.startswith("RuntimeError: checkpoint ") and "loaded, but DeepSpeed " in error, error
    assert "getters read back another value for 0.weight" in error and "DeepSpeed 0.19.8" in error, error
    print(f"verify {one_rank_loads['verify_seconds']:.4f} s of a {one_rank_loads['load_seconds']:.3f} s load")


def assert_loaded(results, stage, option, fresh=()):
    """What a load with option restored: the weights, the fp32 masters and the generators always, and Adam's state
    (optimizer), the scheduler and the counters as saved, or as FRESH has them where fresh names them."""
    got, saved = results[stage, option], results["saved"]
    assert got["draws"] == saved["draws"]  # random, NumPy and torch continue as after the save
    assert all(torch.equal(got["params"][name], value) for name, value in saved["params"].items())
    assert got["optimizer"].keys() == saved["optimizer"].keys()
    for name, state in saved["optimizer"].items():
        assert torch.equal(got["optimizer"][name]["value"], state["value"]), name  # the next step starts here
        if "optimizer" in fresh:
            assert got["optimizer"][name].keys() == {"value"}, name  # no moments
        else:
            assert got["optimizer"][name].keys() == state.keys(), name
            assert all(torch.equal(got["optimizer"][name][key], value) for key, value in state.items()), name
    assert got["steps"] == (FRESH if "optimizer" in fresh else saved)["steps"]
    assert got["scheduler_steps"] == (FRESH if "scheduler" in fresh else saved)["scheduler_steps"]
    assert got["global_steps"] == (FRESH if "counters" in fresh else saved)["global_steps"]


def test_load_ckpt_in_another_shape_restores_the_weights_adam_the_scheduler_the_counters_and_every_generator(
    one_rank_loads,
):
    assert (one_rank_loads["saved"]["steps"], one_rank_loads["saved"]["global_steps"]) == ({2.0}, 2)
    assert one_rank_loads["saved"]["scheduler_steps"] == 2
    assert_loaded(one_rank_loads, 1, "everything")


def test_a_resume_in_another_shape_makes_each_adam_moment_once_per_master_not_once_per_parameter(one_rank_loads):
    """At ZeRO 1 one flat fp32 master holds a whole group's parameters: its two moments are made once each. Made
    once per parameter instead (0.17.0 to 0.18.0), each time the size of the whole master, a 100M-parameter
    resume took 5.5 s instead of 1.1 s (benchmarks/reshape_load.py)."""
    got = one_rank_loads[1, "everything"]
    assert got["masters"] == 2 and got["zeros_made"] == 2 * got["masters"], got["zeros_made"]


@pytest.mark.parametrize("stage", [2, 1])
def test_load_module_only_leaves_adams_state_the_scheduler_and_the_counters_fresh(one_rank_loads, stage):
    assert_loaded(one_rank_loads, stage, "module_only", fresh=("optimizer", "scheduler", "counters"))


@pytest.mark.parametrize("stage", [2, 1])
def test_load_optimizer_states_false_leaves_adams_state_fresh(one_rank_loads, stage):
    assert_loaded(one_rank_loads, stage, "no_optimizer", fresh=("optimizer",))


@pytest.mark.parametrize("stage", [2, 1])
def test_load_lr_scheduler_states_false_leaves_the_scheduler_fresh(one_rank_loads, stage):
    assert_loaded(one_rank_loads, stage, "no_scheduler", fresh=("scheduler",))


def test_an_integer_tag_loads_under_it_and_the_tag_0_is_not_taken_for_no_tag(one_rank_loads):
    assert one_rank_loads["tag_0"] == 0  # not latest's checkpoint, tag 7: a tag need not be a string


class WithUnused(torch.nn.Module):
    """A model with a layer no loss reaches: its parameters never get a gradient from backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.used, self.unused = torch.nn.Linear(FEATURES, OUTPUTS), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def test_adams_step_is_carried_for_a_parameter_no_loss_reaches_across_a_resume_in_another_shape(
    clean_launch_env, tmp_path
):
    states = {}
    for stage in (2, 0):  # saved at ZeRO 2, resumed at ZeRO 0, where torch's AdamW keeps a state per parameter
        strategy = new_strategy(stage)
        model = WithUnused()
        optimizer = strategy.create_optimizer(model, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
        engine, optimizer, _ = strategy.prepare((model, optimizer, None))
        if stage == 2:
            train(strategy, engine, optimizer, None, strategy.setup_dataloader(make_dataset(), MICRO), 2)
            strategy.save_ckpt(engine, str(tmp_path))
        else:
            strategy.load_ckpt(engine, str(tmp_path))
        states[stage] = optimizer_snapshot(engine)
        base = getattr(optimizer, "optimizer", optimizer)
        steps = {name: float(base.state[p]["step"]) for name, p in engine.module.named_parameters() if p in base.state}
    assert steps == {name: 2.0 for name in ("used.weight", "used.bias", "unused.weight", "unused.bias")}
    for name in ("unused.weight", "unused.bias"):  # as DeepSpeed saved them (it steps zero gradients)
        for key, value in states[2][name].items():
            assert torch.equal(states[0][name][key], value), (name, key)


# The states of a save_dir (get_strategy.py's table), each reached as a real run reaches it, in one process.


@pytest.fixture(scope="module")
def save_dir_states(tmp_path_factory):
    out = tmp_path_factory.mktemp("save_dir_states")
    got = {}
    with in_this_process(), contextlib.redirect_stdout(io.StringIO()) as printed:
        strategy = new_strategy(2, train_batch_size=MICRO)
        engine, optimizer, scheduler = prepared(strategy)
        batches = iter(strategy.setup_dataloader(make_dataset(), MICRO))
        train(strategy, engine, optimizer, scheduler, batches, 1)

        def listing(folder):
            return sorted(checkpoints(os.listdir(folder)))

        def loaded(folder, **kwargs):  # (the folder a fresh engine loaded from, its step) and what was printed
            fresh, _, _ = prepared(strategy, init_seed=999)
            start = printed.tell()
            path, _ = strategy.load_ckpt(fresh, str(folder), **kwargs)
            return path and os.path.basename(os.path.dirname(path)), fresh.global_steps, printed.getvalue()[start:]

        # a. A crash after the commit's record, before its rename: the run resumes <tag>.saving; the next save of
        # that tag fails (an object that cannot be pickled): the checkpoint the run resumed from stays.
        rolling = out / "rolling"
        strategy.save_ckpt(engine, str(rolling), tag="last")
        os.rename(rolling / "last", rolling / "last.saving")
        got["resumed_from_saving"] = loaded(rolling)[:2]
        train(strategy, engine, optimizer, scheduler, batches, 1)
        got["resave_fails"] = error_of(
            strategy.save_ckpt, engine, str(rolling), tag="last", client_state={"f": lambda: None}
        )
        got["after_resave_fails"] = (listing(rolling), loaded(rolling)[:2])
        # The record lists the files each rank reported writing: every file of the folder, no more.
        record = json.loads((rolling / "last" / DONE_FILE).read_text())
        got["record_files"] = (sorted(record["files"]), sorted(set(os.listdir(rolling / "last")) - {DONE_FILE}))
        # b. A tag whose folder is no checkpoint: save_model's output, then a checkpoint under its name.
        strategy.save_model(engine, None, str(out / "model" / "final"))
        got["not_a_checkpoint"] = error_of(strategy.save_ckpt, engine, str(out / "model"), tag="final")
        got["not_a_checkpoint_left"] = (listing(out / "model"), listing(out / "model" / "final"))
        # c. Tags that cannot name a checkpoint's folder.
        bad_tags = ["latest", "", ".", "..", "a/b", "x.saving", "x.deleting", "t" * 250, "run "]
        got["bad_tags"] = {tag: error_of(strategy.save_ckpt, engine, str(out / "tags"), tag=tag) for tag in bad_tags}
        got["bad_tags_wrote"] = os.path.exists(out / "tags")
        # d. latest cannot be written: a folder in its place is refused before writing; a latest that cannot be
        # replaced (made immutable, which root cannot override either) fails the save, and what loads is what it
        # said is unchanged, also for a re-save of the tag latest's file named.
        stuck = out / "stuck"
        strategy.save_ckpt(engine, str(stuck), tag="before")
        os.remove(stuck / "latest")
        os.makedirs(stuck / "latest" / "in_the_way")
        got["latest_folder"] = error_of(strategy.save_ckpt, engine, str(stuck), tag="before")
        got["latest_folder_after"] = (listing(stuck), loaded(stuck))
        shutil.rmtree(stuck / "latest")
        (stuck / "latest").write_text("before")
        if subprocess.run(["chattr", "+i", str(stuck / "latest")], capture_output=True).returncode == 0:
            got["latest_fails"] = error_of(strategy.save_ckpt, engine, str(stuck), tag="before")
            subprocess.run(["chattr", "-i", str(stuck / "latest")])
            got["latest_fails_after"] = (listing(stuck), loaded(stuck))
        # d. latest set back by hand to an older checkpoint: it wins, and the load says a newer one exists.
        back = out / "set_back"
        for tag in ("older", "newer"):
            time.sleep(0.01)
            strategy.save_ckpt(engine, str(back), tag=tag)
        (back / "latest").write_text("older")
        got["set_back"] = loaded(back)
        # e. A delete cut short (<name>.deleting, its record already gone) and a write of latest cut short: the next
        # save finishes the one and replaces the other.
        cut = out / "cut_short"
        for tag in ("s1", "s2"):
            strategy.save_ckpt(engine, str(cut), tag=tag)
        os.rename(cut / "s1", cut / "s1.deleting")
        os.remove(cut / "s1.deleting" / DONE_FILE)
        (cut / "latest.tmp").write_text("s")
        got["cut_short_before"] = listing(cut)
        strategy.save_ckpt(engine, str(cut), tag="s4")
        got["cut_short_after"] = listing(cut)
        # Folders of yours named like working folders, and a plain checkpoint you added a file to: never deleted.
        yours = out / "yours"
        for name in ("features.saving", "embeddings.deleting", "old.replaced", "openrlhf_step0"):
            os.makedirs(yours / name)
            torch.save(torch.ones(2), yours / name / "train.pt")
        engine.save_checkpoint(str(yours), tag="openrlhf_step0")  # beside train.pt, DeepSpeed's files
        os.remove(yours / "latest")
        time.sleep(0.01)
        strategy.save_ckpt(engine, str(yours), tag="s1", max_num=1)
        got["yours_after"] = listing(yours)
        # A long tag's save cut short leaves <tag>.saving, 252 bytes: the next saves go ahead.
        long_tag, long_dir = "x" * 245, out / "long"
        strategy.save_ckpt(engine, str(long_dir), tag="s1")
        os.makedirs(long_dir / (long_tag + ".saving"))
        torch.save(torch.ones(2), long_dir / (long_tag + ".saving") / "rng_state_rank0.pt")
        got["long_tag"] = [error_of(strategy.save_ckpt, engine, str(long_dir), tag=tag) for tag in ("s2", long_tag)]
        # f. A NaN metric saves a checkpoint without one; a metric_key JSON cannot write is refused at once.
        start = printed.tell()
        got["nan_error"] = error_of(strategy.save_ckpt, engine, str(out / "nan"), metric_value=float("nan"))
        got["nan_printed"] = printed.getvalue()[start:]
        got["nan_record"] = json.loads(next((out / "nan").glob(f"*/{DONE_FILE}")).read_text())["metric"]
        # ({1: 2} would pass JSON, but come back with "1" for 1: the record's own CRC would then fail.)
        got["bad_key"] = error_of(strategy.save_ckpt, engine, str(out / "bad_key"), metric_value=1.0, metric_key={1: 2})
        got["bad_key_wrote"] = os.path.exists(out / "bad_key")
        # g. Plain DeepSpeed checkpoints (without latest, as copied without it): refused, naming them and the way in.
        plain = out / "plain"
        for tag in ("global_step1", "global_step2"):
            engine.save_checkpoint(str(plain), tag=tag)
        os.remove(plain / "latest")
        got["plain_no_latest"] = error_of(strategy.load_ckpt, engine, str(plain))
        # A damaged plain DeepSpeed checkpoint that latest names gives way to an older one that passes.
        damaged_plain = out / "damaged_plain"
        strategy.save_ckpt(engine, str(damaged_plain), tag="ours")
        engine.save_checkpoint(str(damaged_plain), tag="plain_step")  # latest now names it
        states = damaged_plain / "plain_step" / "mp_rank_00_model_states.pt"
        states.write_bytes(states.read_bytes()[:100])
        got["damaged_plain"] = loaded(damaged_plain)
        got["plain_named"] = error_of(strategy.load_ckpt, engine, str(plain), tag="global_step2")
        # A CUDA generator's state in a checkpoint loaded on a CPU (an evaluation box, CI).
        gpu = out / "gpu"
        strategy.save_ckpt(engine, str(gpu), tag="g")
        rng = torch.load(gpu / "g" / "rng_state_rank0.pt", weights_only=True)
        rng.update(device_type="cuda", device=torch.zeros(16, dtype=torch.uint8))
        got["gpu_rng"] = error_of(Checkpoints(strategy, engine)._set_rng_states, rng)
        # h. A save_dir copied without its files' times (cp -r, an object store and back), latest lost on the way:
        # the first checkpoint saved now looks the newest, the last the oldest.
        copied = out / "copied"
        for tag in ("first", "second", "third"):
            strategy.save_ckpt(engine, str(copied), tag=tag)
        for age, tag in enumerate(("first", "second", "third")):
            for path in (copied / tag / DONE_FILE, copied / tag):
                os.utime(path, (time.time() - 100 * age, time.time() - 100 * age))
        os.remove(copied / "latest")
        got["copied_newest"] = loaded(copied)[0]
        strategy.save_ckpt(engine, str(copied), tag="fourth", max_num=3)
        got["copied_rotated"] = listing(copied)
        # A resume in another shape takes Adam's step as the run's, not that of a parameter which took fewer: a
        # layer frozen but listed in the optimizer has no state at ZeRO 0, so no step.
        steps = {}
        for stage, init_seed in ((0, 1234), (1, 999)):
            stepped = new_strategy(stage, train_batch_size=MICRO)
            model = make_model(init_seed=init_seed)
            model[4].requires_grad_(False)
            adam = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS)
            stepped_engine, adam, _ = stepped.prepare((model, adam, None))
            if stage == 0:
                train(stepped, stepped_engine, adam, None, stepped.setup_dataloader(make_dataset(), MICRO), 3)
                stepped.save_ckpt(stepped_engine, str(out / "frozen"))
            else:
                stepped.load_ckpt(stepped_engine, str(out / "frozen"))
            base = getattr(adam, "optimizer", adam)
            steps[stage] = sorted(
                {float(base.state[p].get("step", 0)) for group in base.param_groups for p in group["params"]}
            )
        got["late_steps_saved"], got["late_steps_loaded"] = steps[0], steps[1]
    return got


def test_a_failed_save_of_the_tag_a_run_resumed_from_never_removes_that_checkpoint(save_dir_states):
    got = save_dir_states
    assert got["resumed_from_saving"] == ("last.saving", 1)  # committed before the crash: it resumes
    assert got["resave_fails"].startswith("RuntimeError: save_ckpt failed on rank 0"), got["resave_fails"]
    listing, resumed = got["after_resave_fails"]
    assert listing == ["last", "latest"] and resumed == ("last", 1), got["after_resave_fails"]


def test_the_record_lists_every_file_the_ranks_wrote_and_only_those(save_dir_states):
    recorded, in_the_folder = save_dir_states["record_files"]
    assert recorded == in_the_folder and "mp_rank_00_model_states.pt" in recorded, (recorded, in_the_folder)


def test_a_tag_whose_folder_is_no_checkpoint_is_refused_before_anything_is_written(save_dir_states):
    error = save_dir_states["not_a_checkpoint"]
    assert error.startswith("RuntimeError: save_ckpt refused before writing: ") and "model/final is no" in error, error
    assert save_dir_states["not_a_checkpoint_left"] == (["final"], ["pytorch_model.bin"])


def test_tags_that_cannot_name_a_checkpoint_folder_are_refused_naming_the_tag_and_why(save_dir_states):
    for tag, error in save_dir_states["bad_tags"].items():
        assert error.startswith(f"ValueError: save_ckpt tag {tag!r} "), (tag, error)
    assert "the file naming the checkpoint to resume" in save_dir_states["bad_tags"]["latest"]
    assert "too long" in save_dir_states["bad_tags"]["t" * 250]
    assert not save_dir_states["bad_tags_wrote"]


def test_a_latest_that_cannot_be_written_fails_the_save_and_the_load_resumes_what_it_said_is_unchanged(
    save_dir_states,
):
    error = save_dir_states["latest_folder"]
    assert error.startswith("RuntimeError: save_ckpt refused before writing: ") and "latest is no file" in error, error
    listing, (folder, steps, printed) = save_dir_states["latest_folder_after"]
    assert listing == ["before", "latest"] and (folder, steps) == ("before", 2), (listing, folder, steps)
    assert "has no 'latest' file: resuming from its newest checkpoint, before" in printed, printed
    if "latest_fails" not in save_dir_states:
        pytest.skip("an immutable latest needs chattr on ext4 (or another filesystem that has it) and root")
    error = save_dir_states["latest_fails"]
    assert error.startswith("RuntimeError: save_ckpt could not commit before in ") and "unchanged" in error, error
    listing, (folder, steps, _) = save_dir_states["latest_fails_after"]
    # latest.tmp is the table's row of a write of latest cut short: the next write of latest replaces it.
    assert listing == ["before", "latest", "latest.tmp"] and (folder, steps) == ("before", 2), (listing, folder, steps)


def test_latest_set_back_by_hand_wins_and_the_load_says_a_newer_checkpoint_exists(save_dir_states):
    folder, _, printed = save_dir_states["set_back"]
    assert folder == "older" and "resuming older, as latest says, though newer is newer" in printed, printed


def test_the_next_save_finishes_deletes_that_were_cut_short(save_dir_states):
    assert save_dir_states["cut_short_before"] == ["latest", "latest.tmp", "s1.deleting", "s2"]
    assert save_dir_states["cut_short_after"] == ["latest", "s2", "s4"]


def test_folders_of_yours_named_like_working_folders_and_a_plain_checkpoint_holding_your_files_are_never_deleted(
    save_dir_states,
):
    kept = ["embeddings.deleting", "features.saving", "latest", "old.replaced", "openrlhf_step0", "s1"]
    assert save_dir_states["yours_after"] == kept


def test_a_long_tags_save_cut_short_does_not_stop_later_saves(save_dir_states):
    assert save_dir_states["long_tag"] == ["no error", "no error"]


def test_a_nan_metric_saves_without_a_metric_and_a_metric_key_that_is_no_string_is_refused_before_writing(
    save_dir_states,
):
    assert save_dir_states["nan_error"] == "no error" and save_dir_states["nan_record"] is None
    assert "metric_value nan is not finite: saving without a metric" in save_dir_states["nan_printed"]
    assert save_dir_states["bad_key"].startswith("ValueError: save_ckpt metric_key {1: 2} must be a name (a string)")
    assert not save_dir_states["bad_key_wrote"]


def test_plain_deepspeed_checkpoints_are_named_with_the_way_in_not_taken_for_a_fresh_start(save_dir_states):
    error = save_dir_states["plain_no_latest"]
    assert error.startswith("ValueError: load_ckpt found plain DeepSpeed checkpoints in "), error
    assert "(global_step1, global_step2), none of its own" in error, error
    for error in (save_dir_states["plain_no_latest"], save_dir_states["plain_named"]):
        assert "engine.load_checkpoint(load_dir, tag) in the shape that saved it, then call save_ckpt" in error, error


def test_a_plain_checkpoint_latest_names_gives_way_to_the_newest_of_this_files(save_dir_states):
    folder, _, printed = save_dir_states["damaged_plain"]
    assert folder == "ours" and "plain_step has no checkpoint_complete.json" in printed, printed
    assert "resuming from ours instead" in printed, printed


def test_a_cuda_generator_state_is_not_handed_to_a_cpu(save_dir_states):
    assert save_dir_states["gpu_rng"] == "no error"


def test_checkpoints_go_in_the_order_their_records_were_committed_in_not_by_their_files_times(save_dir_states):
    """Without latest the newest saved loads, and rotation deletes the oldest saved, whatever the files' times."""
    assert save_dir_states["copied_newest"] == "third"
    assert save_dir_states["copied_rotated"] == ["fourth", "latest", "second", "third"]


def test_a_resume_in_another_shape_takes_adams_step_as_the_runs_not_a_late_parameters(save_dir_states):
    assert save_dir_states["late_steps_saved"] == [0.0, 3.0]  # the frozen layer's state is empty
    assert save_dir_states["late_steps_loaded"] == [3.0]


def test_create_optimizer_lets_a_callers_fused_or_foreach_win_on_cuda(monkeypatch):
    """Only the arguments are checked: torch's fused and foreach AdamW also run on a CPU."""
    monkeypatch.setattr(type(deepspeed.accelerator.get_accelerator()), "device_name", lambda self, *a: "cuda")
    strategy = DeepspeedStrategy(zero_stage=2)
    assert strategy.create_optimizer(make_model()).param_groups[0]["fused"] is True
    assert strategy.create_optimizer(make_model(), fused=False).param_groups[0]["fused"] is False
    assert strategy.create_optimizer(make_model(), foreach=True).param_groups[0]["foreach"] is True


def test_moving_average_before_setup_and_a_foreign_sampler_are_refused_saying_what_to_do():
    strategy = DeepspeedStrategy(zero_stage=2)
    with pytest.raises(RuntimeError, match=r"call strategy.setup_distributed\(\) before strategy.moving_average"):
        strategy.moving_average(make_model(), make_model())
    sampler = torch.utils.data.SequentialSampler(make_dataset())
    with pytest.raises(ValueError, match="setup_dataloader sampler SequentialSampler is not get_strategy's"):
        strategy.setup_dataloader(make_dataset(), 2, sampler=sampler)


def test_save_model_replaces_an_earlier_saves_weights_keeping_other_files_and_leaving_nothing_beside(tmp_path):
    """An earlier save's weights in another format (a model.safetensors, which loaders read before a
    pytorch_model.bin) or shards and their index would be read instead of the new weights, or with them."""
    strategy = DeepspeedStrategy(zero_stage=0)
    target = tmp_path / "model"
    target.mkdir()
    for name in ("model.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"):
        (target / name).write_text("an earlier save's")
    (target / "notes.txt").write_text("mine")
    os.makedirs(target / ".saving-killed")  # what a save_model killed while writing leaves
    Checkpoints(strategy, make_model(init_seed=1))._write_weights({"w": torch.zeros(2)}, None, str(target), {})
    assert sorted(os.listdir(target)) == ["notes.txt", "pytorch_model.bin"]
    assert torch.equal(torch.load(target / "pytorch_model.bin")["w"], torch.zeros(2))


class SavesShards(torch.nn.Linear):
    """A model whose save_pretrained writes two shards, their index and a config, as Hugging Face's does."""

    def save_pretrained(self, folder, state_dict, **kwargs):
        for i, name in enumerate(state_dict):
            torch.save({name: state_dict[name]}, os.path.join(folder, f"pytorch_model-0000{i + 1}-of-00002.bin"))
        Path(folder, "pytorch_model.bin.index.json").write_text(json.dumps(sorted(state_dict)))
        Path(folder, "config.json").write_text(json.dumps({"first": state_dict["weight"].flatten()[0].item()}))


def test_a_save_model_cut_short_between_its_renames_never_leaves_files_of_two_saves(tmp_path, monkeypatch):
    """Cut short after each rename in turn (a kill there leaves what this failure leaves): output_dir holds some
    of the new save's files, never one of the earlier save's beside them."""
    strategy, target = DeepspeedStrategy(zero_stage=0), tmp_path / "model"
    earlier, new = SavesShards(2, 2), SavesShards(2, 2)
    for model, value in ((earlier, 1.0), (new, 2.0)):
        for param in model.parameters():
            torch.nn.init.constant_(param, value)
    replace = os.replace
    for renames in range(4):  # two shards, the config, the index
        Checkpoints(strategy, earlier)._write_weights(earlier.state_dict(), None, str(target), {})
        done = []

        def cut_short(source, destination):
            if len(done) == renames:
                raise OSError("cut short")
            done.append(replace(source, destination))

        monkeypatch.setattr(get_strategy_module.os, "replace", cut_short)
        with contextlib.suppress(OSError):
            Checkpoints(strategy, new)._write_weights(new.state_dict(), None, str(target), {})
        monkeypatch.setattr(get_strategy_module.os, "replace", replace)
        left = sorted(os.listdir(target))
        assert len(left) == renames, (renames, left)
        for name in left:  # each the new save's: its shards, its config, its index
            if name == "config.json":
                assert json.loads((target / name).read_text()) == {"first": 2.0}, name
            elif name.endswith(".bin"):
                assert all(torch.equal(t, torch.full_like(t, 2.0)) for t in torch.load(target / name).values()), name


# =============================================================================================================
# Two processes: one launch of the "core" worker runs every case below, and those of the sections that name it, in
# one process group (the quick tier's cases run likewise in the "quick" launch).


@pytest.fixture(scope="module")
def crash_run(tmp_path_factory):
    """A deepspeed-launcher run whose rank 1 is killed while saving its second checkpoint."""
    out = tmp_path_factory.mktemp("crash")
    cmd = [PYTHON, DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "test_get_strategy.py"]
    cmd += ["--worker", "crash", str(out)]
    try:
        # A hang would last the process group's timeout, an hour; a loaded 2-core machine needs a minute or more.
        returncode, output = launch(cmd, timeout=180)
    except subprocess.TimeoutExpired as expired:
        returncode, output = None, expired.output or ""  # still running after 3 minutes: the test below fails
    return out, returncode, output


@contextlib.contextmanager
def in_this_process():
    """This process as a one-rank world, as under plain `python`; what setup_distributed sets is undone after."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name in LAUNCH_VARS:
            monkeypatch.delenv(name, raising=False)
        yield


@pytest.fixture(scope="module")
def core_run(tmp_path_factory, crash_run, reshape_saved_early):
    out = tmp_path_factory.mktemp("core")
    return two_rank_launch("core", out, crash_run[0], reshape_saved_early, timeout=1200)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """The quick tier's launch of two ranks; its folder holds a small disk."""
    out = tmp_path_factory.mktemp("quick")
    with small_disk(out / "small_disk"):
        return two_rank_launch("quick", out)


def two_rank_launch(worker, out, *folders, timeout=600):
    """(each rank's results, out) of this file's worker launched on two ranks. A rank saves its results after each
    case, so where a case ends the launch (a hang until the process group's timeout, a crash), the cases before it
    still report on their own, and those after say how the launch ended."""
    try:
        returncode, output = launch(torchrun("test_get_strategy.py", "--worker", worker, out, *folders), timeout)
    except subprocess.TimeoutExpired as expired:
        returncode, output = f"a timeout after {timeout} s", expired.output or ""
    results = [read_results(out, rank) for rank in range(WORLD)]
    # A launch that failed although every case ran and raised nothing failed outside them: say so here.
    assert returncode == 0 or not all(result["finished"] and not result["errors"] for result in results), output[-5000:]
    for result in results:
        result["errors"]["ended"] = f"the launch ended with {returncode}:\n{output[-5000:]}"
    return results, out


def case(launched, name):
    """Each rank's result of the case name of a launch; fails with the case's traceback where it raised."""
    results, _ = launched
    for rank, result in enumerate(results):
        assert name not in result["errors"], f"rank {rank} failed in case {name}:\n{result['errors'][name]}"
        assert name in result, f"rank {rank} has no result for case {name}: {result['errors']['ended']}"
    return [result[name] for result in results]


def test_reference_clips_every_step_and_moves_the_weights_far_beyond_the_tolerance():
    final, norms = reference_training()
    assert min(norms) > MAX_NORM  # so the equality below also checks DeepSpeed's clipping
    initial = dict(make_model().named_parameters())
    assert all((final[name] - initial[name]).abs().max() > 100 * 1e-5 for name in final)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_zero_stage_trains_exactly_like_plain_pytorch(quick_run, stage):
    expected, _ = reference_training()
    for got in case(quick_run, f"train_stage{stage}"):
        assert got["global_steps"] == STEPS
        zero = "DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer"
        assert got["optimizer"] == ("AdamW" if stage == 0 else zero)
        assert got["lr"] == pytest.approx(LR * lr_lambda(STEPS))  # the scheduler stepped once per optimizer step
        assert got["partitioned"] == (stage == 3)  # ZeRO 3 holds only a shard of the large weight
        assert got["full_numel"] == sum(p.numel() for p in make_model().parameters())  # at ZeRO 3 ds_numel
        for name, value in expected.items():
            assert (got["params"][name] - value).abs().max().item() < 1e-5, name


@pytest.mark.parametrize("stage", [2, 3])
def test_without_a_scheduler_a_learning_rate_the_loop_sets_by_hand_trains_like_plain_pytorch(quick_run, stage):
    expected, _ = reference_training()
    for got in case(quick_run, f"lr_by_hand_stage{stage}"):
        for name, value in expected.items():
            assert (got[name] - value).abs().max().item() < 1e-5, name


def test_prepare_gives_every_rank_rank_0s_weights_at_every_stage(quick_run):
    expected = dict(make_model(init_seed=1000).named_parameters())
    for got in case(quick_run, "rank_0s_weights"):
        for stage, params in got.items():
            assert all(torch.equal(params[n], p.detach()) for n, p in expected.items()), stage


@pytest.mark.full
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_adam_offload_steps_on_cpu_adam_and_matches_plain_pytorch(core_run, stage):
    expected, _ = reference_training()
    for got in case(core_run, f"offload_stage{stage}"):
        assert got["basic_optimizer"] == "DeepSpeedCPUAdam"
        for name, value in expected.items():
            assert (got["params"][name] - value).abs().max().item() < 1e-5, name


@pytest.mark.full
def test_adam_offload_resumed_late_in_a_run_ends_bit_identical_to_the_uninterrupted_run(core_run):
    """ZeRO 2, bf16, adam_offload: 20 steps, saved at step 10. DeepSpeedCPUAdam's compiled side keeps beta ** step as
    a running product, which a fresh optimizer computes with pow() instead, a few ulps away (0.21.0 and DeepSpeed's
    own load both ended 0.0047 from the uninterrupted run on an H200); the load replays the products."""
    for got in case(core_run, "offload_late"):
        assert got["moved"] > 1e-3 and got["diff"] == 0.0, got


@pytest.mark.full
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_training_lowers_the_loss(core_run, stage):
    for got in case(core_run, f"bf16_stage{stage}"):
        assert got["param_dtype"] == "torch.bfloat16"
        first_epoch, last_epoch = got["epoch_losses"][0], got["epoch_losses"][-1]
        assert last_epoch < 0.5 * first_epoch, got["epoch_losses"]


def test_all_reduce_and_all_gather_return_what_hand_computation_gives(quick_run):
    for rank, got in enumerate(case(quick_run, "collectives")):
        # rank 0 contributes [1, 2], rank 1 contributes [3, 4]
        assert torch.equal(got["mean"], torch.tensor([2.0, 3.0]))
        assert torch.equal(got["max"], torch.tensor([3.0, 4.0]))
        assert torch.equal(got["sum"], torch.tensor([4.0, 6.0]))
        assert torch.equal(got["input_after"], torch.tensor([1.0, 2.0]) + 2 * rank)  # the caller's tensor is untouched
        assert got["int_sum"] == 2**40 + 1 and isinstance(got["int_sum"], int)  # rank r gives 2**40 * (1 - r) + r
        assert got["float_mean"] == 0.75  # 0.5 and 1.0
        assert got["dict"] == {"loss": 1.5, "tokens": 2**40 + 1}
        assert torch.equal(got["gather_tensor"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        assert torch.equal(got["gather_number"], torch.tensor([0.5, 1.0], dtype=torch.float64))
        assert torch.equal(got["gather_scalar"], torch.tensor([0, 1]))


def test_bools_and_integers_reduce_exactly(quick_run):
    for rank, got in enumerate(case(quick_run, "collectives")):
        assert torch.equal(got["bool_mean"], torch.tensor([0.5, 1.0], dtype=torch.float64))  # [rank == 0, True]
        assert torch.equal(got["bool_sum"], torch.tensor([2, 2]))  # a count, int64
        assert torch.equal(got["bool_max"], torch.tensor([True]))
        assert torch.equal(got["int_mean"], torch.tensor(2**25 + 1, dtype=torch.float64))  # float32 would round it
        assert got["python_bool_sum"] == 1 and type(got["python_bool_sum"]) is int


def test_dicts_reduce_and_gather_by_key_whatever_their_order_on_each_rank(quick_run):
    for rank, got in enumerate(case(quick_run, "collectives")):
        assert got["dict_by_key"] == {"a": 2, "b": 200}
        assert list(got["dict_by_key"]) == (["a", "b"] if rank == 0 else ["b", "a"])  # the caller's order
        assert torch.equal(got["gather_dict_by_key"]["x"], torch.tensor([0, 1]))
        assert torch.equal(got["gather_dict_by_key"]["y"], torch.tensor([0, -1]))
        for name in ("keys_differ", "gather_keys_differ"):
            assert got[name].startswith("ValueError: ") and "needs the same keys on every rank" in got[name], got[name]


def test_all_gather_concatenates_tensors_of_different_lengths_in_rank_order(quick_run):
    for got in case(quick_run, "collectives"):
        assert torch.equal(got["ragged"], torch.tensor([0, 10, 11]))  # rank 0: [0], rank 1: [10, 11]
        assert torch.equal(got["ragged_rows"], torch.tensor([[0.0] * 3, [1.0] * 3, [1.0] * 3]))
        assert got["gather_columns_differ"].startswith("ValueError: all_gather: only the first dimension may differ")


@pytest.mark.full
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_training_continues_from_weights_loaded_with_load_model(core_run, stage):
    """Loaded after a step and followed by one, at lr 0. The forward pass right after the load computes with
    the loaded weights (at ZeRO 3 a stale whole copy of a small weight would not), and the step leaves them as
    they are (a stale fp32 master copy would write the old ones back; stage 0 runs in bf16, where DeepSpeed keeps
    such a copy too)."""
    loaded = make_model(init_seed=7)
    for got in case(core_run, f"load_model_then_step_stage{stage}"):
        tolerance = 2e-2 if stage == 0 else 1e-5  # stage 0 runs in bf16
        torch.testing.assert_close(got["output"], loaded(got["inputs"]).detach(), rtol=tolerance, atol=tolerance)
        assert got["steps"] == 2
        for name, value in got["params"].items():
            assert torch.equal(value, loaded.state_dict()[name].to(value.dtype)), name


@pytest.mark.full
def test_a_model_built_under_zero_init_gets_weight_decay_groups_and_trains_like_plain_pytorch(core_run):
    expected, _ = reference_training()
    for got in case(core_run, "zero_init"):
        assert got["sharded_at_build"]
        for name, value in expected.items():
            assert (got["params"][name] - value).abs().max().item() < 1e-5, name


@pytest.mark.full
def test_without_overlap_comm_deepspeeds_default_holds_on_at_zero_3_off_below(core_run):
    for got in case(core_run, "overlap_comm"):
        assert got == {(2, False): False, (2, True): True, (3, False): True, (3, True): True}


@pytest.mark.full
@pytest.mark.parametrize("stage", [2, 3])
def test_save_model_keeps_every_key_of_state_dict_and_writes_tied_weights_once(core_run, stage):
    got = case(core_run, f"tied_stage{stage}")[0]
    assert got["keys"] == list(got["expected"])  # block_again.* and head.weight included, as state_dict has them
    for name, value in got["expected"].items():
        assert torch.equal(got["saved"][name], value), name
    assert got["tie_kept"]
    # One copy of each distinct tensor: the embedding (512 x 256), the block's weight and bias, in fp32. A second
    # copy of the head (524,288 bytes) or of the block (263,168) would show; pickling adds a few kilobytes.
    distinct = (512 * 256 + 256 * 256 + 256) * 4
    assert distinct < got["file_bytes"] < distinct + 64 * 1024


@pytest.mark.full
def test_load_ckpt_module_only_loads_zero_3_weights(core_run):
    for got in case(core_run, "module_only_zero3"):
        for name, value in got["saved"].items():
            assert torch.equal(got["loaded"][name], value), name


@pytest.mark.full
def test_load_ckpt_module_only_loads_a_two_rank_zero_3_checkpoint_into_one_rank(core_run, clean_launch_env):
    _, out = core_run
    expected = case(core_run, "module_only_zero3")[0]["saved"]
    strategy = get_strategy(argparse.Namespace(zero_stage=3, micro_train_batch_size=MICRO, train_batch_size=MICRO))
    strategy.setup_distributed()
    model = make_model(init_seed=999)
    engine, _, _ = strategy.prepare((model, strategy.create_optimizer(model, lr=LR), None))
    _, client_state = strategy.load_ckpt(engine, str(out / "module_only"), load_module_only=True)
    for name, value in full_params(engine).items():
        assert torch.equal(value, expected[name]), name
    # The weights alone: the counters stay the fresh engine's, and client_state holds none of DeepSpeed's own state.
    assert engine.global_steps == 0
    assert not {"module", "optimizer", "lr_scheduler", "global_steps"} & set(client_state), sorted(client_state)


@pytest.mark.full
def test_a_node_that_sees_no_checkpoint_is_named_on_every_rank_instead_of_hanging(core_run):
    """Rank 0 alone chooses the checkpoint; rank 1, checking its share of the files, finds its own missing."""
    for got in (rank["node_sees_nothing"] for rank in case(core_run, "node_local")):
        assert got.startswith("RuntimeError: checkpoint "), got
        assert re.search(r"node_local_nothing/global_step0/rng_state_rank1.pt is missing on \S+$", got), got


@pytest.mark.full
def test_a_node_that_cannot_see_rank_0s_files_refuses_the_checkpoint_on_every_rank(core_run):
    """Rank 1 checks its own files, which its node has; rank 0's model states, which it reads, are not there."""
    for got in (rank["node_local"] for rank in case(core_run, "node_local")):
        assert got.startswith("RuntimeError: checkpoint ") and "does not load on rank 1 " in got, got
        assert "mp_rank_00_model_states.pt is missing on " in got, got  # rank 0's


def test_dataloader_gives_each_rank_a_disjoint_seeded_shard_and_skips_consumed_samples(quick_run):
    ranks = case(quick_run, "dataloader")
    epoch0 = [r["epoch0"] for r in ranks]
    assert sorted(epoch0[0] + epoch0[1]) == list(range(20))  # disjoint and complete
    assert epoch0[0] + epoch0[1] != list(range(0, 20, 2)) + list(range(1, 20, 2))  # shuffled
    for r in ranks:
        assert r["epoch0_again"] == r["epoch0"]  # the same seed gives the same order
        assert r["resumed"] == r["epoch0"][4:]  # 8 consumed samples over 2 ranks: 4 of this rank's
        assert r["resumed_len"] == len(r["epoch0"]) // 2 - 2  # batches of 2
        assert r["epoch1"] != r["epoch0"]  # set_epoch reshuffles
        assert r["never_set_epochs"][:2] == [r["epoch0"], r["epoch1"]]  # without set_epoch: the next epoch
        assert r["never_set_epochs"][2] not in r["never_set_epochs"][:2]


def test_the_sampler_has_openrlhfs_name_and_set_epoch_signature():
    from get_strategy import DistributedSampler

    assert list(inspect.signature(DistributedSampler.set_epoch).parameters) == ["self", "epoch", "consumed_samples"]
    assert issubclass(DistributedSampler, torch.utils.data.DistributedSampler)


@pytest.mark.full
@pytest.mark.parametrize("stage", [2, 3])
def test_an_actor_trains_through_its_engine_like_plain_pytorch_and_saves_without_a_prefix(core_run, stage):
    expected, _ = reference_training()
    for rank, got in enumerate(case(core_run, f"actor_stage{stage}")):
        assert got["returned_the_actor"] and got["holds"] == "DeepSpeedEngine"  # as OpenRLHF's prepare does
        for name, value in expected.items():
            assert (got["params"][name] - value).abs().max().item() < 1e-5, name
        if rank == 0:
            assert got["saved_keys"] == sorted(make_model().state_dict())


@pytest.mark.full
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_moving_average_updates_once_per_optimizer_step_as_hand_computed(core_run, stage):
    for got in case(core_run, f"moving_average_stage{stage}"):
        for name, before in got["before"].items():
            assert torch.equal(got["after_one_call"][name], before), name
            expected = 0.9 * before + 0.1 * got["model"][name]
            assert torch.allclose(got["after"][name], expected, rtol=0, atol=1e-7), name
            if not torch.equal(got["model"][name], before):  # LayerNorm weights are 1 in both models
                assert not torch.equal(got["after"][name], before), name


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_resuming_from_a_checkpoint_continues_exactly(quick_run, stage, dtype):
    """N steps, save, M more steps; against: fresh engines loaded from the checkpoint, M steps. The model has
    dropout and the data comes through a shuffled loader resumed with consumed_samples."""
    for got in case(quick_run, f"resume_stage{stage}_{dtype}"):
        assert got["resumed_losses"] == got["uninterrupted_losses"][-len(got["resumed_losses"]) :]
        assert got["client_state"] == {"consumed_samples": 3 * TRAIN, "note": "hello"}
        for name, value in got["uninterrupted_params"].items():
            assert torch.equal(got["resumed_params"][name], value), name
        assert got["fresh_params_differed"]  # the fresh engine did not start from the same weights by chance


@pytest.mark.full
def test_rotation_keeps_the_newest_max_num_and_never_touches_other_folders(core_run):
    got = case(core_run, "rotation")[0]
    assert got["after_each_save"] == [
        ["global_step1", "latest", "notes"],
        ["global_step1", "global_step2", "latest", "notes"],
        ["global_step2", "global_step3", "latest", "notes"],
    ]
    assert got["notes_intact"]
    assert got["latest"] == "global_step3"


@pytest.mark.full
def test_rotation_evicts_the_oldest_by_size_under_max_mem(core_run):
    got = case(core_run, "rotation")[0]
    # max_mem fits two and a half checkpoints: after the third save the oldest goes.
    assert got["by_size"] == ["global_step1-2", "global_step1-3"]


@pytest.mark.full
def test_rotation_deletes_checkpoints_without_a_metric_then_the_lowest_then_the_oldest_and_keeps_one_best(core_run):
    """OpenRLHF 0.10's rules, with max_num=2: a tag starting with "best" is not counted and never rotated out, a new
    best replaces the older one, and neither the new checkpoint nor latest's goes (s10 is saved without latest)."""
    got = case(core_run, "checkpoint_rules")[0]
    assert got["by_metric"] == [
        ["s1"],
        ["s1", "s2"],
        ["s1", "s3"],  # s2 had no metric
        ["best_s4", "s1", "s3"],  # a best one is not counted
        ["best_s4", "s3", "s5"],  # s1 (0.5) was the lowest but for the new one
        ["best_s6", "s3", "s5"],  # the new best replaced the older
        ["best_s6", "s3", "s7"],  # s5 (0.1)
        ["best_s6", "s3", "s8"],  # s7 (0.3)
        ["best_s6", "s8", "s9"],  # s3 and s8 tie at 0.9: the older goes
        ["best_s6", "s10", "s9"],  # s9 is latest's, so s8 goes though s9 ties with it
    ]
    assert got["record_metric"] == {"key": "reward", "value": 0.9}


@pytest.mark.full
def test_max_mem_counts_a_best_checkpoint_which_rotation_still_never_deletes(core_run):
    got = case(core_run, "checkpoint_rules")[0]
    assert got["by_size"] == [["best_a", "r1"], ["best_a", "r2"]]


@pytest.mark.full
def test_rotation_never_deletes_plain_deepspeed_checkpoints_of_a_run_that_moved_onto_this_file(core_run):
    got = case(core_run, "checkpoint_rules")[0]
    assert got["moved"] == [["global_step1", "global_step2", "global_step3"]]  # not this file's to delete


@pytest.mark.full
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_groups_listed_in_another_order_are_refused_and_in_the_same_order_keep_their_schedules(core_run, stage):
    """Groups, their hyperparameters and the scheduler's per-group lists pair by position (as DeepSpeed's own load
    pairs them): another order is refused, naming both groupings; the same order keeps each layer's group its lr,
    its Adam state and its schedule, and 2 more steps end where the uninterrupted run does."""
    for got in case(core_run, f"groups_by_name_stage{stage}"):
        assert got["other_order"].startswith("RuntimeError: checkpoint "), got["other_order"]
        assert "optimizer groups do not match this run's: saved [['0.weight', '0.bias'], [" in got["other_order"]
        assert got["lrs"] == got["saved_lrs"], got
        assert got["max_difference"] < 1e-6, got["max_difference"]


def test_a_metric_value_that_is_no_number_is_refused_naming_it(clean_launch_env):
    strategy = DeepspeedStrategy(zero_stage=2, train_batch_size=1)
    strategy.setup_distributed()  # a one-process group: the refusal is shared with every rank
    for value in ("0.5", True, 10**400, torch.tensor([1.0, 2.0])):
        with pytest.raises(ValueError, match="save_ckpt metric_value .* must be a number, or None"):
            strategy.save_ckpt(None, "unused", tag="t", metric_value=value)
    assert Checkpoints(strategy, None)._metric(numpy.float32(0.5), "reward") == ({"key": "reward", "value": 0.5}, None)
    assert Checkpoints(strategy, None)._metric(torch.tensor(2.0), None) == ({"key": None, "value": 2.0}, None)


@pytest.mark.full
def test_rotation_keeps_a_linked_checkpoint_as_a_foreign_folder_and_what_it_links_to_intact(core_run):
    got = case(core_run, "checkpoint_rules")[0]
    assert got["branch_error"] == "no error", got["branch_error"]
    assert got["branch"] == ["global_step1", "s3", "s4"]
    assert got["archive_intact"]


@pytest.mark.full
def test_a_rotation_that_fails_after_the_commit_keeps_the_new_checkpoint_and_says_what_failed(core_run):
    got = case(core_run, "checkpoint_rules")[0]
    if not got["busy_mounted"]:
        pytest.skip("an undeletable folder needs a mount, which needs root")
    assert got["busy_error"] == "no error" and got["busy_next"] == "no error", got
    # The folder was on its way out: renamed to old.deleting (no checkpoint any more), the mount still in it.
    assert got["busy"] == ["new", "old.deleting"] and got["busy_latest"] == "newer"
    assert "new is saved in" in got["busy_printed"] and "tidying up after it failed" in got["busy_printed"]


@pytest.mark.full
def test_a_metric_value_that_is_nan_on_one_rank_still_saves_on_every_rank_with_rank_0s_metric(core_run):
    for got in case(core_run, "checkpoint_rules"):
        assert got["nan_error"] == "no error" and got["nan_metric"] == {"key": None, "value": 0.5}, got


@pytest.mark.full
def test_a_crashed_saves_staging_folder_goes_with_the_next_successful_save(core_run):
    got = case(core_run, "checkpoint_rules")[0]
    assert got["stale"] == [["global_step1", "global_step3"]]


@pytest.mark.full
def test_a_checkpoints_own_folder_given_as_load_dir_is_refused_naming_the_parent_and_tag(core_run):
    for got in case(core_run, "checkpoint_rules"):
        error = got["load_dir_is_checkpoint"]
        assert error.startswith("ValueError: load_ckpt load_dir ") and "is one checkpoint" in error, error
        assert "metric'" in error and "tag='s9'" in error, error


@pytest.mark.full
def test_a_first_save_that_cannot_copy_deepspeeds_scripts_raises_on_every_rank_within_seconds(core_run):
    for got in case(core_run, "checkpoint_rules"):
        assert got["scripts_error"].startswith("RuntimeError: save_ckpt failed on rank 0 "), got["scripts_error"]
        assert "zero_to_fp32.py" in got["scripts_error"], got["scripts_error"]
        assert got["scripts_seconds"] < 30 and got["scripts"] == [], got  # no staging folder left


@pytest.mark.full
def test_a_folder_without_checkpoints_loads_nothing_and_an_incomplete_checkpoint_fails_on_every_rank(core_run):
    for got in case(core_run, "load_errors"):
        assert got["missing"] == (None, {})  # what OpenRLHF's trainers from 0.9.10 on check for a fresh start
        # A save cut short leaves <tag>.saving; a <tag>/ of DeepSpeed's files without a record is no checkpoint of
        # this file's (a plain DeepSpeed one, or one whose record was lost): named, with the way in.
        assert got["incomplete"].startswith("ValueError: checkpoint ") and "half" in got["incomplete"]
        assert "has no checkpoint_complete.json" in got["incomplete"], got["incomplete"]
        # A tag whose committed checkpoint sits in <tag>.saving (cut short before its rename) loads from there.
        assert got["swapped_named"] == "no error" and "global_step0.saving" in got["swapped_found"]


def test_a_truncated_or_damaged_file_is_named_on_every_rank_which_all_stop_at_once(quick_run):
    for got in case(quick_run, "damaged"):
        assert got["truncated"].startswith("RuntimeError: checkpoint "), got["truncated"]
        assert re.search(
            r"zero_pp_rank_1_mp_rank_00_optim_states.pt has \d+ bytes, not the \d+ saved", got["truncated"]
        )
        assert got["damaged"].startswith("RuntimeError: checkpoint "), got["damaged"]
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt is damaged" in got["damaged"], got["damaged"]


# A file of each kind a checkpoint holds, as DeepSpeed names them at ZeRO 2 (rank 1's where each rank writes one).
ONE_OF_EACH_KIND = dict(model="mp_rank_00_model_states.pt", rng="rng_state_rank1.pt")
ONE_OF_EACH_KIND["optimizer"] = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


@pytest.mark.parametrize("kind", ONE_OF_EACH_KIND)
def test_a_bit_flipped_in_any_kind_of_checkpoint_file_is_named_on_every_rank(quick_run, kind):
    for got in case(quick_run, "damaged"):
        assert got[f"flipped_{kind}"].startswith("RuntimeError: checkpoint "), got[f"flipped_{kind}"]
        assert f"{ONE_OF_EACH_KIND[kind]} is damaged (Bad CRC-32" in got[f"flipped_{kind}"], got[f"flipped_{kind}"]


def test_with_no_tag_a_damaged_newest_checkpoint_is_named_and_the_next_newest_resumes(quick_run):
    ranks = case(quick_run, "damaged")
    for got in ranks:
        assert got["fallback"]["which"] == "older"
        assert got["named_tag_damaged"].startswith("RuntimeError: ") and "is damaged" in got["named_tag_damaged"]
    printed = ranks[0]["fallback"]["printed"]  # rank 0 says so
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt is damaged" in printed and "resuming from older" in printed


def test_a_checkpoint_of_another_model_is_refused_on_every_rank_naming_the_first_differing_tensors(quick_run):
    for got in case(quick_run, "damaged"):
        assert got["other_model"].startswith("ValueError: checkpoint "), got["other_model"]
        assert "holds another model: 5 tensors differ (0.bias: saved [256], here [128], " in got["other_model"]


def test_zero_3_load_optimizer_states_false_loads_the_weights_of_the_checkpoint_chosen(quick_run):
    for got in case(quick_run, "load_corners"):
        assert max(got["a_tag"].values()) == 0.0, got["a_tag"]  # global_step1's, not latest's global_step3
        assert got["a_saving"] == "no error", got["a_saving"]
        assert max(got["a_saving_diff"].values()) == 0.0, got["a_saving_diff"]
        assert got["a_after_eval"] == 0.0, got["a_after_eval"]  # found by the review of release 0.21.0's load


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("bf16", (False, True))
def test_load_optimizer_states_false_trains_on_from_the_loaded_weights_at_every_stage_and_dtype(quick_run, stage, bf16):
    for got in case(quick_run, "load_corners"):
        moved = got[f"b_{stage}_{bf16}"]
        # One Adam step from the checkpoint's weights (each weight moves by about lr at most, plus one bf16 rounding
        # step of a weight near 1, 2**-7), far from the fresh engine's random start (0.004 from it and 0.121 from
        # the checkpoint on release 0.20.0 at ZeRO 0 with bf16).
        assert moved["from_checkpoint"] < 2 * LR + (2**-7 if bf16 else 0), moved
        assert moved["from_start"] > 0.03, moved


@pytest.mark.parametrize("stage", range(4))
def test_a_load_that_fails_on_one_rank_raises_on_every_rank_within_seconds_naming_rank_and_file(quick_run, stage):
    for got in case(quick_run, "load_corners"):
        assert got[f"c_{stage}"].startswith("RuntimeError: "), got[f"c_{stage}"]
        assert "on rank 1" in got[f"c_{stage}"] and "Input/output error" in got[f"c_{stage}"], got[f"c_{stage}"]
        assert "_states.pt" in got[f"c_{stage}"], got[f"c_{stage}"]
        assert got[f"c_{stage}_seconds"] < 60


def test_a_second_model_saving_into_another_models_save_dir_is_refused_before_writing(quick_run):
    for got in case(quick_run, "load_corners"):
        assert got["d_critic"].startswith("RuntimeError: save_ckpt refused before writing: "), got["d_critic"]
        assert "another model" in got["d_critic"] and "a save_dir per model" in got["d_critic"], got["d_critic"]
        assert checkpoints(got["d_listing"]) == ["global_step1", "latest"] and got["d_actor_loads"] == "no error"


@pytest.mark.parametrize("stage", (0, 3))
def test_an_eval_engines_save_is_refused_before_writing_saying_why(quick_run, stage):
    for got in case(quick_run, "load_corners"):
        assert got[f"e_{stage}"].startswith("ValueError: save_ckpt "), got[f"e_{stage}"]
        assert "save_model" in got[f"e_{stage}"], got[f"e_{stage}"]
        assert got[f"e_{stage}_listing"] == [], got[f"e_{stage}_listing"]


def test_a_best_checkpoint_whose_rotation_was_cut_short_is_rotated_by_the_next_save(quick_run):
    for got in case(quick_run, "load_corners"):
        assert checkpoints(got["best_listing"]) == ["best_b", "global_step9", "latest"], got["best_listing"]


def test_tag_latest_is_refused_saying_it_names_the_file_and_tag_none_loads_what_it_names(quick_run):
    for got in case(quick_run, "load_corners"):
        assert got["tag_latest"].startswith("ValueError: load_ckpt tag 'latest'"), got["tag_latest"]
        assert "tag=None" in got["tag_latest"], got["tag_latest"]


# Issue 46: every rank resumes what it saved. Each case below was reproduced on release 0.21.0 first.


def test_zero_3_resumes_a_trained_parameter_its_optimizer_does_not_hold_as_it_was_saved(quick_run):
    for got in case(quick_run, "own"):
        assert got["a"] == "no error", got["a"]  # 0.21.0: KeyError ('scale', 'value') on every rank
        assert got["a_scale"] == 2.5 and max(got["a_diff"].values()) == 0.0, got


def test_zero_2_resumed_at_zero_3_loads_a_group_that_is_only_padding_on_one_rank(quick_run):
    for got in case(quick_run, "own"):
        assert got["b"] == "no error", got["b"]  # 0.21.0: KeyError ('scale', 'value') on every rank
        assert max(got["b_diff"].values()) == 0.0, got["b_diff"]  # weights, fp32 masters and Adam's moments


def test_at_zero_3_each_rank_resumes_its_own_buffers_and_client_state(quick_run):
    ranks = case(quick_run, "own")
    assert ranks[0]["c_saved_mean"] != ranks[1]["c_saved_mean"]  # each rank's batches gave it its own statistics
    for rank, got in enumerate(ranks):
        assert got["c_cursor"] == 1000 + rank and got["c_mean"] == got["c_saved_mean"], got  # 0.21.0: rank 0's
    # At ZeRO 0-2 DeepSpeed writes rank 0's model states alone: every rank resumes rank 0's (the README says so).
    assert [got["c_cursor_zero2"] for got in ranks] == [1000, 1000]


def test_a_stale_copy_of_a_file_one_rank_reads_is_refused_on_every_rank_naming_it(quick_run):
    for got in case(quick_run, "own"):
        # 0.21.0: no error; rank 1 resumed step 2's counters while rank 0 resumed step 4's.
        assert got["d"].startswith("RuntimeError: checkpoint "), got["d"]
        assert "on rank 1" in got["d"] and "mp_rank_00_model_states.pt" in got["d"], got["d"]


def test_once_load_ckpt_returns_no_checkpoint_file_stays_mapped_so_rotation_frees_its_space(quick_run):
    for got in case(quick_run, "own"):
        assert got["e_maps_before"], "the test saw no mapped checkpoint file during a load"  # it can fail
        assert got["e_maps"] == [], got["e_maps"]  # 0.21.0: .../global_step1.deleting/...model_states.pt (deleted)
        assert got["e_tensor"] == list(range(4)), got


def test_a_checkpoint_that_other_ranks_see_but_rank_0_does_not_is_named_on_every_rank(quick_run):
    for got in case(quick_run, "own"):
        assert got["f"].startswith("RuntimeError: load_ckpt: rank 0 sees no checkpoint in "), got["f"]  # 0.21.0:
        assert "rank 1 sees global_step0" in got["f"], got["f"]  # (None, {}) on every rank, a fresh start


def test_load_ckpt_refuses_a_tag_that_is_not_one_folder_name(quick_run):
    for got in case(quick_run, "own"):
        for tag in ("global_step0/", "../own_tag/global_step0"):
            assert got[f"tag {tag}"].startswith(f"ValueError: load_ckpt tag {tag!r} must be "), got[f"tag {tag}"]


def test_a_read_error_while_checking_raises_on_every_rank_instead_of_falling_back_to_an_older_checkpoint(quick_run):
    for got in case(quick_run, "own"):
        for where in ("file", "record", "stat"):  # 0.21.0: resumed from "older", printing one line
            assert got[f"eio_{where}"].startswith("RuntimeError: "), got[f"eio_{where}"]
            assert "Input/output error" in got[f"eio_{where}"] or "Stale file handle" in got[f"eio_{where}"], got
        assert "on rank 1" in got["eio_file"] and "on rank 0" in got["eio_record"] and "on rank 1" in got["eio_stat"], (
            got
        )
        # load_model's shared check too: every rank refuses at once, none waits for rank 1 in a collective.
        assert got["load_model_eio"].startswith("ValueError: refusing to load: "), got["load_model_eio"]
        assert "cannot be read on rank 1" in got["load_model_eio"] and got["load_model_eio_seconds"] < 30, got


def test_client_state_keys_of_deepspeeds_own_are_refused_before_anything_is_written(quick_run):
    for got in case(quick_run, "own"):
        assert got["keys"].startswith("ValueError: save_ckpt client_state key 'global_steps' "), got["keys"]
        assert got["keys_listing"] == [], got["keys_listing"]
        # Every entry DeepSpeed writes into the model states is one save_ckpt refuses (a newer DeepSpeed may add).
        assert set(got["deepspeed_keys"]) - {"mine"} <= get_strategy_module.RESERVED_KEYS, got


def test_a_failed_save_leaves_no_saving_folder_on_a_node_that_does_not_share_save_dir(quick_run):
    for rank, got in enumerate(case(quick_run, "own")):
        assert got["node_error"].startswith("RuntimeError: save_ckpt failed on rank 1 "), got["node_error"]
        assert got["node_listing"] == [], got["node_listing"]  # 0.21.0: global_step9.saving stayed on rank 1's node
        # In the background: found before anything is copied, raised at the next call, nothing left either.
        assert got["node_background"] == "no error", got
        assert got["node_background_next"].startswith("RuntimeError: save_ckpt failed on rank 1 "), got
        assert got["node_background_listing"] == [], got


def test_prepare_refuses_a_compiled_module_naming_the_engines_own_compile(clean_launch_env):
    """nanoGPT compiles before wrapping: at ZeRO 3 DeepSpeed then failed at the first forward ('dict' object has no
    attribute '_in_forward'), below it the checkpoints' names gained "_orig_mod."."""
    strategy = new_strategy(3, train_batch_size=MICRO * ACCUM)
    compiled = torch.compile(make_model())  # compiles nothing until its first call
    for item in ((compiled, strategy.create_optimizer(compiled, lr=LR), None), compiled):
        with pytest.raises(ValueError, match=r"torch.compile\(\) wrapped: pass the model itself.*engine.compile\(\)"):
            strategy.prepare(item)


@pytest.mark.full
@pytest.mark.parametrize("stage", [2, 3])
def test_the_engine_compiled_after_prepare_trains_like_the_eager_one_and_saves_the_plain_names(tmp_path, stage):
    """The README's way to torch.compile: engine.compile() on what prepare returns (inductor, on the CPU)."""
    final = {}
    with in_this_process():
        strategy = new_strategy(stage, train_batch_size=MICRO * ACCUM)
        for compiled in (False, True):
            engine, optimizer, scheduler = prepared(strategy)
            if compiled:
                engine.compile()
            train(strategy, engine, optimizer, scheduler, strategy.setup_dataloader(make_dataset(), MICRO), 3)
            strategy.save_ckpt(engine, str(tmp_path / str(compiled)))
            final[compiled] = full_params(engine)
    record = json.loads(next((tmp_path / "True").glob(f"*/{DONE_FILE}")).read_text())
    assert sorted(record["tensors"]) == sorted(dict(make_model().named_parameters()))  # no "_orig_mod." prefix
    moved = max((final[False][n] - p).abs().max().item() for n, p in make_model().named_parameters())
    differs = max((final[True][n] - final[False][n]).abs().max().item() for n in final[False])
    assert differs < 1e-4 < moved, (differs, moved)  # inductor's kernels sum in another order


def test_adam_offload_with_a_loops_own_optimizer_is_refused_at_prepare_naming_create_optimizer(clean_launch_env):
    """nanoGPT's configure_optimizers builds torch's AdamW: DeepSpeed refused it inside deepspeed.initialize with
    advice about ds_config keys the strategy does not expose."""
    strategy = new_strategy(2, train_batch_size=MICRO * ACCUM, adam_offload=True)
    model = make_model()
    with pytest.raises(
        ValueError,
        match=r"--adam_offload .* DeepSpeedCPUAdam, which load_ckpt resumes, and prepare got AdamW.*create_optimizer",
    ):
        strategy.prepare((model, torch.optim.AdamW(model.parameters()), None))


def test_fp16_is_refused_naming_bf16():
    with pytest.raises(ValueError, match=r"--fp16 True .*--bf16"):
        get_strategy(argparse.Namespace(zero_stage=2, fp16=True))
    get_strategy(argparse.Namespace(zero_stage=2, fp16=False))  # OpenRLHF's store_true default


# Issue 47: a save that does not stop training. save_ckpt(background=True) returns once every rank holds a copy of
# its state in CPU memory; a thread writes, agrees and commits.


@pytest.mark.parametrize("stage", (2, 3))
def test_a_background_save_returns_before_writing_and_loads_back_the_state_at_the_call_though_training_went_on(
    quick_run, stage
):
    for got in case(quick_run, "background"):
        mine = got[f"consistent_{stage}"]
        # Nothing committed yet, and global_step1 still what latest names.
        assert mine["listing_at_return"] == ["global_step1", "global_step2.saving", "latest"], mine
        assert mine["moved_meanwhile"] > 1e-3, mine  # the training changed the state while the write ran
        assert mine["loaded_vs_call"] == 0.0 and mine["steps"] == 2, mine  # the state at the call, to the bit
        assert mine["committed"] == ["global_step1", "global_step2", "latest"], mine


@pytest.mark.parametrize("stage", (2, 3))
def test_a_background_saves_snapshot_takes_the_bytes_per_parameter_the_readme_gives(quick_run, stage):
    """fp32 on 2 ranks: Adam's fp32 master and two moments, 12 bytes a parameter, shared out over the ranks; at ZeRO
    1-2 rank 0 also holds the module's weights (4 bytes a parameter in fp32), which it alone writes."""
    for rank, got in enumerate(case(quick_run, "background")):
        expected = 12 / WORLD + (4 if stage < 3 and rank == 0 else 0)
        assert abs(got[f"consistent_{stage}"]["bytes_per_parameter"] - expected) < 0.2, (rank, got)


def test_a_background_save_keeps_one_snapshot_in_buffers_it_reuses_as_large_as_the_files_tensors(quick_run):
    for got in case(quick_run, "background"):
        snapshot = got["snapshot"]
        assert snapshot["reused"] and 0 < snapshot["bytes"] <= snapshot["file_bytes"], snapshot
        assert 0 < snapshot["after_fewer"] <= snapshot["after_fewer_file_bytes"], snapshot  # shrunk with the state
        assert snapshot["kept_with_one_more"], snapshot  # matched by size, not by place: one more shifts nothing


@pytest.mark.parametrize("stage", (2, 3))
def test_a_background_saves_checkpoint_holds_the_same_files_and_loads_the_same_objects_as_a_synchronous_one(
    quick_run, stage
):
    for got in case(quick_run, "background"):
        alike = got[f"alike_{stage}"]
        foreground, background = alike["client_state"]
        assert foreground["kinds"]["ema"] == ["Parameter", True], foreground  # torch.save's own semantics
        assert foreground["same_object"] == [True, True] and foreground["view_shares_storage"], foreground
        assert background == foreground
        assert alike["state_difference"] == 0.0, alike
        assert alike["names"][0] == alike["names"][1], alike["names"]
        assert alike["files_differing"] == [], alike["files_differing"]


def test_a_background_write_that_fails_on_one_rank_raises_on_every_rank_at_the_next_call_and_changes_nothing(
    quick_run,
):
    for got in case(quick_run, "background"):
        failed = got["failed"]
        assert failed["returned"] == "no error", failed  # the call itself only copied
        assert failed["error"].startswith("RuntimeError: save_ckpt failed on rank 1 "), failed["error"]
        assert "global_step3.saving" in failed["error"] and "ulimit -f" in failed["error"], failed["error"]
        assert failed["seconds"] < 30 and failed["latest"] == "global_step2", failed
        assert checkpoints(failed["listing"]) == ["global_step1", "global_step2", "latest"], failed["listing"]
        assert failed["saved_after"] == "no error", failed  # and the run saves again


def test_get_strategy_reads_background_save_from_args_and_save_ckpt_follows_it(quick_run):
    for got in case(quick_run, "background"):
        assert got["flag"] == ["global_step1.saving"], got["flag"]  # save_ckpt() without the keyword


def test_a_background_save_without_a_thread_to_run_it_saves_on_the_callers_thread(quick_run):
    for got in case(quick_run, "background"):
        assert got["no_thread"] == "no error" and got["no_thread_latest"] == "no_thread", got
        assert got["no_thread_after"] == "no error", got  # and no save is left pending for a later call to hang on


def test_deepspeeds_own_save_while_a_background_save_writes_is_the_callers_and_no_part_of_the_checkpoint(quick_run):
    for rank, got in enumerate(case(quick_run, "background")):
        assert f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" in got["deepspeed_meanwhile"], got
        assert got["ours_after"] == "no error", got["ours_after"]  # its record lists its own files alone


def test_a_rank_waiting_for_others_at_a_call_every_rank_must_make_names_them_and_waits_on(quick_run):
    rank0, rank1 = case(quick_run, "arrivals")
    assert rank0["late"] == rank1["late"] == "no error"  # a rank that is only slow fails nothing
    waited = "rank 0 has waited 1 s in save_ckpt for ranks [1]: every rank must call save_ckpt"
    assert rank0["printed"].count(waited) == 1 and rank1["printed"] == "", (rank0, rank1)
    assert rank0["after"] == rank1["after"] == "no error", (rank0, rank1)


def test_save_ckpt_on_rank_0_alone_says_so_and_fails_as_soon_as_the_other_rank_dies(ending_launches):
    alone = ending_launches["alone"]
    assert "rank 0 has waited 1 s in save_ckpt for ranks [1]: every rank must call save_ckpt" in alone["outputs"][0]
    assert alone["returncodes"] == [0, 9] and alone["error"] != "no error", alone
    assert alone["seconds"] < 60, alone  # not the process group's 30 minutes


@pytest.mark.full
def test_a_background_save_pending_at_exit_without_teardown_is_finished_before_the_process_ends(background_launches):
    exited = background_launches["exit"]
    assert exited["record"] and exited["latest"] == "global_step1", exited  # committed after the script returned
    assert exited["loads"] == "no error", exited


def test_a_background_save_that_fails_as_the_script_ends_is_printed_and_exits_with_1_after_the_scripts_handlers(
    ending_launches,
):
    failed = ending_launches["exit_failed"]
    assert failed["returncodes"] == [1, 1], failed  # not 0: a scheduler sees the run's last checkpoint missing
    assert all("save_ckpt failed on rank 1 " in output for output in failed["outputs"]), failed["outputs"]
    assert failed["latest"] == "global_step0" and checkpoints(failed["listing"]) == ["global_step0", "latest"], failed
    # The script's own exit handlers ran (a tracker's final sync), though registered before the save.
    assert failed["handlers"] == ["trainer_handler_ran_0", "trainer_handler_ran_1"], failed


def test_ctrl_c_while_a_call_waits_for_a_background_save_leaves_it_pending_and_the_next_save_waits_for_it(
    ending_launches,
):
    got = ending_launches["signals"]
    assert all("interrupted" in output for output in got["outputs"]), got["outputs"]  # the signal came in the wait
    assert got["loads"]["a"] == 0.0 and got["loads"]["b"] == 0.0, got  # each loads the weights at its call


def test_a_sigterm_handler_that_exits_while_a_call_waits_ends_the_process_once_the_save_is_committed(
    ending_launches,
):
    got = ending_launches["signals"]
    assert got["returncodes"] == [143, 143], got  # the handler's exit code, after the save
    assert not any("saved d" in output for output in got["outputs"]), got["outputs"]
    assert got["latest"] == "c" and got["loads"]["c"] == 0.0, got
    assert checkpoints(got["listing"]) == ["a", "b", "c", "latest"], got["listing"]


@pytest.mark.full
def test_a_rank_killed_during_a_background_write_makes_the_next_call_raise_on_the_others_within_seconds(
    background_launches,
):
    killed = background_launches["killed"]
    assert killed["rank1_returncode"] == -signal.SIGKILL, killed
    assert killed["error"].startswith("RuntimeError: save_ckpt of global_step2 failed in the background on rank 0"), (
        killed
    )
    assert killed["seconds"] < 60, killed
    assert killed["latest"] == "global_step1" and "global_step2" not in killed["listing"], killed


@pytest.mark.full
def test_load_ckpt_runs_code_a_checkpoint_carries_which_its_docstring_warns_of(core_run):
    """DeepSpeed unpickles checkpoints (weights_only=False); the docstring and README must say so."""
    for got in case(core_run, "load_errors"):
        assert got["payload_ran"]
    assert "Load only checkpoints you trust" in DeepspeedStrategy.load_ckpt.__doc__


@pytest.mark.full
def test_save_model_under_zero_3_writes_the_gathered_weights_that_load_into_a_plain_module(core_run):
    got = case(core_run, "save_model_zero3")[0]
    assert got["files"] == ["pytorch_model.bin"]  # and no temporary file left behind
    for name, value in got["gathered"].items():
        assert torch.equal(got["saved"][name], value), name
        assert torch.equal(got["loaded_into_plain"][name], value), name
    assert got["params_were_partitioned"]  # the engine really held shards, so the gather did something


@pytest.mark.full
def test_save_model_leaves_every_ranks_weights_unchanged(core_run):
    """Gathering for the save must not disturb the shards. DeepSpeed 0.16.0 to 0.19.7 read ZeRO 3 gathers on
    gloo before all of them had arrived (fixed upstream in deepspeedai/DeepSpeed#8539), which this caught."""
    for got in case(core_run, "save_model_zero3"):
        for before, after in (("gathered_here", "after_save_here"), ("eval_before_save_here", "eval_after_save_here")):
            for name, value in got[before].items():
                assert torch.equal(got[after][name], value), (after, name)


@pytest.mark.full
def test_save_model_under_zero_3_writes_persistent_buffers_like_state_dict(core_run):
    got = case(core_run, "save_model_zero3")[0]
    assert sorted(got["buffers_saved"]) == sorted(got["buffers_expected"])  # BatchNorm's, not the scratch one
    for name, value in got["buffers_expected"].items():
        assert torch.equal(got["buffers_saved"][name], value), name


@pytest.mark.full
def test_load_model_fills_every_shard_of_a_zero_3_engine(core_run):
    for got in case(core_run, "save_model_zero3"):
        for name, value in got["gathered_here"].items():
            assert torch.equal(got["loaded_into_engine"][name], value), name


@pytest.mark.full
def test_save_model_goes_through_save_pretrained_with_the_gathered_state_dict_and_saves_the_tokenizer(core_run):
    got = case(core_run, "save_model_zero3")[0]
    assert got["pretrained_files"] == ["config.json", "model.bin", "tokenizer.json"]
    assert got["pretrained_kwargs"] == ["safe_serialization"]  # extra keyword arguments are passed on
    for name, value in got["pretrained_gathered"].items():
        assert torch.equal(got["pretrained_saved"][name], value), name


@pytest.mark.full
def test_prepare_returns_eval_engines_for_bare_models_and_a_list_for_several(core_run):
    for got in case(core_run, "prepare_eval"):
        assert got["kinds"] == ["tuple", "DeepSpeedEngine"]
        assert got["eval_stage"] == [0, 3]
        assert got["eval_outputs_match_plain_module"] == [True, True]


@pytest.mark.full
def test_a_rank_killed_while_saving_over_the_latest_tag_leaves_the_previous_checkpoint_loadable(crash_run, core_run):
    out, returncode, output = crash_run
    assert returncode is not None, "the launch was still running 3 minutes after it started"
    assert returncode != 0, output[-3000:]
    assert sorted(n for n in os.listdir(out / "ckpt") if not n.endswith(".py")) == ["last", "last.saving", "latest"]
    assert (out / "ckpt" / "latest").read_text() == "last"
    assert not (out / "ckpt" / "last.saving" / "checkpoint_complete.json").exists()
    saved = torch.load(out / "params_at_step2.pt", weights_only=True)
    for got in case(core_run, "load_after_crash"):
        assert got["load_path"].endswith("last/mp_rank_00_model_states.pt")
        assert got["global_steps"] == 2
        for name, value in saved.items():
            assert torch.equal(got["params"][name], value), name


@pytest.mark.full
def test_a_busy_port_and_a_missing_rank_are_named_with_the_fix():
    """One process, as rank 0 of the deepspeed launcher sees it: first its port is taken, then it waits alone."""
    _, output = launch([PYTHON, "test_get_strategy.py", "--worker", "rendezvous"], 120)
    busy, alone = json.loads(next(line for line in reversed(output.splitlines()) if line.startswith("[")))
    assert re.search(
        r"port 127.0.0.1:\d+ is already in use.*--master_port \d+ \(the deepspeed launcher and torchrun", busy
    )
    assert "not every rank arrived at 127.0.0.1:" in alone and "1/2 clients joined" in alone, alone


MPI_VARS = {  # each MPI launcher's variables for the world size, the rank and the local rank
    "Open MPI": ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "MVAPICH": ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_LOCAL_RANK"),
    "MPICH, Intel MPI": ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID"),
}


@pytest.mark.full
def test_train_batch_size_mismatch_fails_fast_on_both_ranks_before_any_process_group():
    """Two independent processes (no launcher to kill the survivor): each must raise on its own, before any
    collective; a rank that waited for the other would hang and time out here. Alongside, one rank of each MPI
    launcher's world of 2, told only by its variables, raises alike before joining."""
    port = str(free_port())
    worlds = [dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1") for rank in (0, 1)]
    worlds = [dict(world, MASTER_PORT=port) for world in worlds]
    worlds += [dict(zip(names, ("2", "1", "1"))) for names in MPI_VARS.values()]
    procs = [started([PYTHON, "test_get_strategy.py", "--worker", "mismatch"], world) for world in worlds]
    expected = "--train_batch_size 6 must be a multiple of --micro_train_batch_size * world_size = 2 * 2 = 4"
    for proc, world in zip(procs, worlds):
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode != 0, world
        assert f"ValueError: {expected} (try 4 or 8)" in output, (world, output)
        assert "process group initialized: False" in output, (world, output)


# =============================================================================================================
# Two processes, in the core launch: get_grad_norm, the loader's state and a strategy that has not joined the
# process group yet.


@pytest.mark.full
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("max_norm", [MAX_NORM, 0])
def test_get_grad_norm_is_plain_pytorchs_norm_before_clipping_after_every_step(core_run, stage, max_norm):
    # Within 2e-6 (7.7e-7 measured). Clipped, the norm would be MAX_NORM; with max_norm 0 the norms after the
    # first step differ from MAX_NORM's by 1.3e-4 to 2.6e-3, as the weights no longer clip.
    _, expected = reference_training(max_norm=max_norm)
    for got, mid_way in case(core_run, f"grad_norm_stage{stage}_max_norm{max_norm}"):
        assert all(type(norm) is float for norm in got)
        assert got == pytest.approx(expected, rel=2e-6)
        # Mid-way through an accumulation: still the last step's; before the first step 0.0, as OpenRLHF 0.10.1's
        # trainers, which log it after every micro-step, get from OpenRLHF's own strategy.
        assert mid_way == [0.0] * (ACCUM - 1) + [norm for norm in got[:-1] for _ in range(ACCUM - 1)]


@pytest.mark.full
def test_get_grad_norm_reaches_the_engine_through_an_actor(core_run):
    _, expected = reference_training()
    for got, _ in case(core_run, "grad_norm_actor"):
        assert got == pytest.approx(expected, rel=2e-6)


@pytest.mark.full
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_get_grad_norm_at_bf16_is_plain_pytorchs_within_bf16_rounding(core_run, stage):
    # Within 5e-2 of the fp32 run's, from which bf16 weights drift step by step: 1.8e-2 measured at ZeRO 0, whose
    # gradients stay bf16, and 3.1e-3 at ZeRO 1-3. A clipped norm would be MAX_NORM.
    _, expected = reference_training()
    for got, _ in case(core_run, f"grad_norm_bf16_stage{stage}"):
        assert all(type(norm) is float for norm in got)
        assert got == pytest.approx(expected, rel=5e-2)


@pytest.mark.full
@pytest.mark.parametrize("shuffle, set_epoch, consumed_samples", ROUND_TRIPS)
def test_on_two_ranks_a_loader_restored_from_any_state_yields_what_the_uninterrupted_one_does(
    core_run, shuffle, set_epoch, consumed_samples
):
    ranks = case(core_run, f"round_trips_{shuffle}_{set_epoch}_{consumed_samples}")
    for trips, epochs in ranks:
        assert len(trips) == 1 + sum(len(epoch) for epoch in epochs) + 3
        for after, resumed in trips:
            assert resumed == after
    second_pass = [[i for batch in epochs[1] for i in batch] for _, epochs in ranks]
    assert sorted(second_pass[0] + second_pass[1]) == list(range(20))  # each rank its own half


@pytest.mark.full
def test_a_loaders_state_carried_in_a_checkpoint_resumes_its_batches_on_two_ranks(core_run):
    for got in case(core_run, "loader_through_a_checkpoint"):
        assert len(got["resumed"]) == 10 + 16  # the rest of the epoch, then the next one
        assert torch.equal(got["resumed"], got["uninterrupted"])


@pytest.mark.full
def test_a_strategy_not_set_up_yet_gives_each_rank_its_shard_of_the_existing_process_group(core_run):
    for rank, got in enumerate(case(core_run, "loader_before_setup")):
        assert got == list(range(rank, 20, WORLD))  # unshuffled: every WORLD-th sample from the rank's own


@pytest.mark.full
def test_at_zero_3_every_rank_refuses_a_file_whose_damage_only_rank_1_reads_in_load_model(core_run):
    for got in case(core_run, "load_model_verdict_zero3"):
        assert got.startswith("ValueError: refusing to load: ") and "is damaged (Bad CRC-32 for file" in got, got


@pytest.mark.full
def test_the_readmes_usage_block_runs_as_written_on_two_ranks_and_trains_like_plain_pytorch(core_run):
    # Plain PyTorch on the same two global batches of 32: the sampler's epoch 0 under the default seed 42 (ranks
    # take every other sample; a step's 4 micro-batches of 4 on each rank are 32 consecutive ones), AdamW as
    # create_optimizer groups it, clipping at the default max_norm 1.0.
    model = make_model()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    decay, no_decay = [model[0].weight, model[4].weight], [model[0].bias, model[1].weight, model[1].bias, model[4].bias]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95))
    x, y = make_dataset().tensors
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(42))
    for step in range(2):
        batch = order[step * 32 : (step + 1) * 32]
        optimizer.zero_grad()
        F.mse_loss(model(x[batch]), y[batch]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    for got in case(core_run, "readme_usage"):
        for name, p in model.named_parameters():
            assert (p - initial[name]).abs().max() > 1e-4  # the weights moved far beyond the tolerance
            assert (got[name] - p).abs().max() < 1e-5, name


# =============================================================================================================
# Resuming in another shape: another number of ranks, ZeRO stage, dtype or adam_offload. Each case trains 2
# steps in shape A, saves, resumes in shape B into a model initialised elsewhere, and trains 2 more; the weights
# must equal plain PyTorch's 4 steps. Launches: one rank in this process and three ranks before the core launch
# (which resumes them), the core launch's own checkpoints resumed after it on one rank and on three.

RESHAPE_WIDTH = 257  # odd: no world size here divides the first layer's 131,584 elements, nor the biases
RESHAPE_TRAIN = 12  # samples per optimizer step: whole micro-batches of MICRO on 1, 2 and 3 ranks
RESHAPE_CASES = {  # name: (saved by (ranks, stage, flags), resumed on (ranks, stage, flags))
    "z2_2r_to_z3_1r": ((2, 2, {}), (1, 3, {})),
    "z2_2r_to_z3_2r": ((2, 2, {}), (2, 3, {})),
    "z2_2r_to_z2_1r": ((2, 2, {}), (1, 2, {})),
    "z0_2r_to_z0_1r": ((2, 0, {}), (1, 0, {})),
    "z3_2r_to_z2_1r": ((2, 3, {}), (1, 2, {})),
    "z1_1r_to_z3_2r": ((1, 1, {}), (2, 3, {})),
    "z0_2r_to_z3_3r": ((2, 0, {}), (3, 3, {})),
    "z3_3r_to_z0_2r": ((3, 3, {}), (2, 0, {})),
    "z3_offload_2r_to_z1_2r": ((2, 3, {"adam_offload": True}), (2, 1, {})),
    "z3_bf16_2r_to_z2_2r": ((2, 3, {"bf16": True}), (2, 2, {})),
    "z3_bf16_2r_to_z2_bf16_1r": ((2, 3, {"bf16": True}), (1, 2, {"bf16": True})),
}


class ReshapeModel(torch.nn.Module):
    """Tied weights, a frozen layer, a buffer, parameters with and without weight decay, sizes no world divides."""

    def __init__(self, init_seed=1234):
        super().__init__()
        torch.manual_seed(init_seed)
        self.first = torch.nn.Linear(FEATURES, RESHAPE_WIDTH)  # above ZeRO 3's persistence threshold: sharded
        self.norm = torch.nn.LayerNorm(RESHAPE_WIDTH)
        self.frozen = torch.nn.Linear(RESHAPE_WIDTH, RESHAPE_WIDTH)
        self.frozen.requires_grad_(False)
        self.mix_a = torch.nn.Linear(RESHAPE_WIDTH, RESHAPE_WIDTH, bias=False)
        self.mix_b = torch.nn.Linear(RESHAPE_WIDTH, RESHAPE_WIDTH, bias=False)
        self.mix_b.weight = self.mix_a.weight  # tied
        self.out = torch.nn.Linear(RESHAPE_WIDTH, OUTPUTS)
        self.register_buffer("scale", 1 + 0.1 * torch.randn(RESHAPE_WIDTH))

    def forward(self, x):
        h = F.gelu(self.norm(self.first(x)) * self.scale.to(x.dtype))
        h = h + 0.1 * self.frozen(h)
        return self.out(self.mix_b(F.gelu(self.mix_a(h))))


def warmup(step):
    return (step + 1) / 10  # still warming up after 4 steps: the scheduler's position matters


def reshape_reference(steps=4, reset_at=None, reset=(), start=None):
    """Plain PyTorch, one process, global batches of RESHAPE_TRAIN samples. reset ("moments", "step") forgets
    that part of Adam's state after reset_at steps: what a resume that failed to carry it would compute. start
    (the state after 2 steps: tensors, exp_avg and exp_avg_sq by name) begins at step 3 from it instead."""
    model = ReshapeModel()
    decay = [model.first.weight, model.mix_a.weight, model.out.weight]  # named by hand: the matrices
    no_decay = [model.first.bias, model.norm.weight, model.norm.bias, model.out.bias]
    optimizer, scheduler = reference_optimizer(decay, no_decay, warmup)
    x, y = make_dataset().tensors
    if start is not None:
        model.load_state_dict(start["tensors"])
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            moments = {key: start[key][name].clone() for key in ("exp_avg", "exp_avg_sq")}
            optimizer.state[p] = {"step": torch.tensor(2.0), **moments}
        with pytest.warns(UserWarning):  # stepping the scheduler without the optimizer: that is the point here
            scheduler.step(), scheduler.step()
    for step in range(2 if start is not None else 0, steps):
        if step == reset_at:
            for state in optimizer.state.values():
                if "moments" in reset:
                    state["exp_avg"].zero_(), state["exp_avg_sq"].zero_()
                if "step" in reset:
                    state["step"].zero_()
        batch = slice(step * RESHAPE_TRAIN, (step + 1) * RESHAPE_TRAIN)
        optimizer.zero_grad()
        F.mse_loss(model(x[batch]), y[batch]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        scheduler.step()
    tensors = {name: t.detach().clone() for name, t in model.state_dict().items()}
    return tensors, scheduler.get_last_lr()


def reshape_engine(strategy, init_seed, model_class=ReshapeModel, freeze=(), groups="create_optimizer", **kwargs):
    """ReshapeModel (or model_class) prepared with AdamW: create_optimizer's groups, or a user's (groups "all" or
    "reversed"); freeze names submodules frozen before; kwargs go to the optimizer."""
    model = model_class(init_seed)
    for name in freeze:
        model.get_submodule(name).requires_grad_(False)
    options = dict(lr=LR, betas=BETAS, eps=EPS, **kwargs)
    if groups == "all":  # a user's optimizer over every parameter, frozen ones too, in one group
        optimizer = torch.optim.AdamW(model.parameters(), **options)
    elif groups == "reversed":  # create_optimizer's two groups, listed the other way round
        decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
        groups = [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": WEIGHT_DECAY}]
        optimizer = torch.optim.AdamW(groups, **options)
    else:
        optimizer = strategy.create_optimizer(model, weight_decay=WEIGHT_DECAY, **options)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    return strategy.prepare((model, optimizer, scheduler))


def reshape_strategy(stage, **flags):
    return new_strategy(stage, train_batch_size=RESHAPE_TRAIN, **flags)


def reshape_train(strategy, engine, optimizer, scheduler, steps, consumed_samples=0):
    loader = strategy.setup_dataloader(make_dataset(), MICRO, shuffle=False, consumed_samples=consumed_samples)
    train(strategy, engine, optimizer, scheduler, loader, steps)


def full_state(engine):
    """module.state_dict() at full size (gathered under ZeRO 3), as float32 copies."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_partition_weights()):
        return {name: t.detach().float().clone() for name, t in engine.module.state_dict().items()}


def reshape_save(name, out_dir):
    """Shape A of a case: 2 steps, then a checkpoint in out_dir/name."""
    (_, stage, flags), _ = RESHAPE_CASES[name]
    strategy = reshape_strategy(stage, **flags)
    engine, optimizer, scheduler = reshape_engine(strategy, init_seed=1234)
    reshape_train(strategy, engine, optimizer, scheduler, 2)
    strategy.save_ckpt(engine, os.path.join(out_dir, name), client_state={"consumed_samples": 2 * RESHAPE_TRAIN})
    return saved_state(engine) if flags.get("bf16") else None


def saved_state(engine):
    """The fp32 master weights and Adam's moments by name, as DeepSpeed's own public getters report them (all
    ranks must call it), with the module's other tensors: the start for reshape_reference."""
    state = dict(tensors=full_state(engine), exp_avg={}, exp_avg_sq={})
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            state["tensors"][name] = safe_get_full_fp32_param(p).float().cpu()
            for key in ("exp_avg", "exp_avg_sq"):
                state[key][name] = safe_get_full_optimizer_state(p, key).float().cpu()
    state["tensors"]["mix_b.weight"] = state["tensors"]["mix_a.weight"]  # tied: one parameter, two names
    return state


def reshape_resume(name, out_dir, stage=None):
    """Shape B of a case (at another ZeRO stage where given): a model initialised elsewhere, the checkpoint loaded,
    2 more steps."""
    _, (_, case_stage, flags) = RESHAPE_CASES[name]
    stage = case_stage if stage is None else stage
    strategy = reshape_strategy(stage, **flags)
    engine, optimizer, scheduler = reshape_engine(strategy, init_seed=999)
    _, client_state = strategy.load_ckpt(engine, os.path.join(out_dir, name))
    loaded = dict(global_steps=engine.global_steps, global_samples=engine.global_samples, lr=scheduler.get_last_lr())
    loaded["loaded"] = optimizer_snapshot(engine) if flags.get("bf16") else None  # masters and moments, as loaded
    reshape_train(strategy, engine, optimizer, scheduler, 2, client_state["consumed_samples"])
    return dict(loaded, state=full_state(engine), weight_decay=[g["weight_decay"] for g in optimizer.param_groups])


def reshape_cases_of(ranks, side):
    return [name for name, shapes in RESHAPE_CASES.items() if shapes[side][0] == ranks]


@pytest.fixture(scope="module")
def reshape_saved_early(tmp_path_factory):
    """The checkpoints of one rank (in this process) and of three ranks, which the core launch resumes."""
    out = tmp_path_factory.mktemp("reshape")
    with in_this_process():
        for name in reshape_cases_of(1, side=0):
            reshape_save(name, str(out))
    returncode, output = launch(torchrun("test_get_strategy.py", "--worker", "reshape_save3", str(out), ranks=3), 300)
    assert returncode == 0, output[-5000:]
    return out


@pytest.fixture(scope="module")
def reshape_results(core_run, reshape_saved_early):
    """Every case's resumed run, by name: the core launch's, and the rest resumed here and on three ranks."""
    _, out = core_run
    got = {name: case(core_run, f"shape_b_{name}")[0] for name in reshape_cases_of(2, side=1)}
    got["saved"] = {name: case(core_run, f"shape_a_{name}")[0] for name in reshape_cases_of(2, side=0)}
    reshape_dir = str(reshape_saved_early)
    with in_this_process():
        for name in reshape_cases_of(1, side=1):
            got[name] = reshape_resume(name, reshape_dir)
    three = out / "reshape3"
    cmd = torchrun("test_get_strategy.py", "--worker", "reshape_resume3", str(reshape_dir), str(three), ranks=3)
    returncode, output = launch(cmd, 300)
    assert returncode == 0, output[-5000:]
    got.update(torch.load(three / "results.pt", weights_only=True))
    return got


def test_the_reshape_reference_moves_far_beyond_the_tolerance_when_moments_or_step_are_forgotten():
    """What makes the cases below able to fail: forgetting Adam's moments or its step at the resume moves the
    4-step weights by far more than their 1e-5 tolerance."""
    carried, _ = reshape_reference()
    for reset in ("moments", "step"):
        forgot, _ = reshape_reference(reset_at=2, reset=(reset,))
        assert max((forgot[n] - carried[n]).abs().max().item() for n in carried) > 1e-4, reset


@pytest.mark.full
@pytest.mark.parametrize("name", [name for name in RESHAPE_CASES if "bf16" not in name])
def test_a_checkpoint_resumes_in_another_shape_like_plain_pytorch(reshape_results, name):
    assert_reshaped_like(reshape_results[name], reshape_reference()[0], tolerance=1e-5)


@pytest.mark.full
def test_a_bf16_checkpoint_resumes_in_fp32_like_plain_pytorch_from_the_saved_state(reshape_results):
    """Two bf16 steps do not equal fp32 steps, so the reference starts from what the bf16 run saved (its fp32
    masters and moments, read through DeepSpeed's getters) and computes steps 3 and 4 in plain fp32 PyTorch."""
    name = "z3_bf16_2r_to_z2_2r"
    start = reshape_results["saved"][name]
    assert_reshaped_like(reshape_results[name], reshape_reference(start=start)[0], tolerance=1e-5)
    for reset in ("moments", "step"):  # what the test would see had the resume forgotten them
        forgot, _ = reshape_reference(start=start, reset_at=2, reset=(reset,))
        assert max((forgot[n] - reshape_reference(start=start)[0][n]).abs().max().item() for n in forgot) > 1e-4
    # And against the fp32 run throughout: bf16 rounds each of the first two steps' weights to 8 bits.
    assert_reshaped_like(reshape_results[name], reshape_reference()[0], tolerance=3e-3)


BF16_STEPS = 4e-3  # how far 2 steps in bf16 end from fp32's: 8-bit weights, and Adam amplifies rounded gradients


@pytest.mark.full
def test_a_bf16_checkpoint_resumes_in_bf16_on_one_rank_within_bf16_rounding(reshape_results):
    """The load gives the fp32 masters and Adam's moments the bf16 run saved, exactly (DeepSpeed's getters on both
    sides); 2 more steps in bf16 then end within BF16_STEPS of the reference above (2.8e-3 measured)."""
    name = "z3_bf16_2r_to_z2_bf16_1r"
    saved, loaded = reshape_results["saved"][name], reshape_results[name]["loaded"]
    assert loaded.keys() == {n for n, p in ReshapeModel().named_parameters() if p.requires_grad}
    for param, state in loaded.items():
        assert torch.equal(state["value"], saved["tensors"][param]), param
        assert all(torch.equal(state[key], saved[key][param]) for key in ("exp_avg", "exp_avg_sq")), param
    assert_reshaped_like(reshape_results[name], reshape_reference(start=saved)[0], tolerance=BF16_STEPS)


@pytest.mark.full
def test_a_resume_in_another_shape_reads_the_checkpoint_in_place_and_writes_nothing_beside_it(
    reshape_results, reshape_saved_early
):
    """The checkpoint of two ranks at ZeRO 2, after one rank resumed it at ZeRO 3."""
    folder = reshape_saved_early / "z2_2r_to_z3_1r" / "global_step2"
    assert sorted(checkpoints(os.listdir(folder.parent))) == ["global_step2", "latest"]
    done = json.loads((folder / "checkpoint_complete.json").read_text())
    assert {n: (folder / n).stat().st_size for n in done["files"]} == done["files"]  # the original as saved
    assert sorted(os.listdir(folder)) == sorted([*done["files"], "checkpoint_complete.json"])


def assert_reshaped_like(got, expected, tolerance):
    assert got["global_steps"] == 2 and got["global_samples"] == 2 * RESHAPE_TRAIN
    assert got["lr"] == pytest.approx([LR * warmup(2)] * 2)  # the scheduler resumed mid-warm-up
    assert got["weight_decay"] == [WEIGHT_DECAY, 0.0]
    assert got["state"].keys() == expected.keys()
    for key, value in expected.items():  # the frozen layer and the buffer came from the checkpoint too
        difference = (got["state"][key] - value).abs().max().item()
        assert difference < tolerance, (key, difference)


def run_reshape_save3(out_dir):
    for name in reshape_cases_of(3, side=0):
        reshape_save(name, out_dir)
    DeepspeedStrategy(zero_stage=0).teardown()


def run_reshape_resume3(reshape_dir, out_dir):
    results = {name: reshape_resume(name, reshape_dir) for name in reshape_cases_of(3, side=1)}
    if int(os.environ["RANK"]) == 0:
        os.makedirs(out_dir, exist_ok=True)
        torch.save(results, os.path.join(out_dir, "results.pt"))
    DeepspeedStrategy(zero_stage=0).teardown()


# =============================================================================================================
# train_example.py: every launch mode, determinism, resuming, and the saved weights.

# The example at its smallest: one block of width 32 over 200 kB, 8 steps of 8 sequences of 32 bytes.
TINY = "--n_layer 1 --n_head 2 --n_embd 32 --block_size 32 --data_bytes 200000".split()
TINY += "--micro_train_batch_size 2 --train_batch_size 8 --max_steps 8 --warmup_steps 2 --learning_rate 1e-2".split()
TINY += "--eval_steps 4 --eval_batches 4 --logging_steps 1".split()
# Two ranks, ZeRO 3, deterministic, a checkpoint every 4 steps: the runs below that share these flags must agree.
SHARED = [*TINY, "--zero_stage", "3", "--full_determinism", "--save_steps", "4"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # the same intra-op threads under every launcher, so results can be compared


def run_example(cmd, timeout=180):
    returncode, output = launch(cmd, timeout=timeout, env=ONE_THREAD)
    assert returncode == 0, output[-5000:]
    return output


def losses(output, kind):
    """{step: loss} from the example's log lines of that kind ("train" or "held-out")."""
    return {int(step): float(loss) for step, loss in re.findall(rf"step +(\d+) \| {kind} loss ([\d.]+)", output)}


def final_loss(output):
    return float(re.search(r"final held-out loss ([\d.]+)", output).group(1))


@pytest.fixture(scope="module")
def example_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("example")


def saved_to(example_dir, name):
    """The flags that send a run's checkpoints and final weights into example_dir under name."""
    return ["--ckpt_path", str(example_dir / f"ckpt_{name}"), "--save_path", str(example_dir / f"weights_{name}")]


def weights(example_dir, name):
    """The final weights, as bytes, that the run saved_to(example_dir, name) wrote."""
    return (example_dir / f"weights_{name}" / "pytorch_model.bin").read_bytes()


@pytest.fixture(scope="module")
def deepspeed_two_ranks(example_dir):
    """The uninterrupted run the others are compared with: SHARED under the deepspeed launcher."""
    launcher = [PYTHON, DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port())]
    return run_example([*launcher, "train_example.py", *SHARED, *saved_to(example_dir, "ds")])


def assert_learns(output, ranks):
    assert f"{ranks} ranks x" in output
    held_out = losses(output, "held-out")
    assert held_out[8] < held_out[0] - 0.05, held_out
    assert "final held-out loss" in output and "sample: def " in output


def test_default_global_batch_is_32_rounded_up_to_whole_micro_steps(monkeypatch):
    from train_example import parse_args

    for world_size, micro, expected in (("1", "8", 32), ("2", "8", 32), ("3", "8", 48), ("8", "8", 64), ("2", "5", 40)):
        monkeypatch.setenv("WORLD_SIZE", world_size)
        assert parse_args(["--micro_train_batch_size", micro]).train_batch_size == expected


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--micro_train_batch_size", "0"], "--micro_train_batch_size 0 must be at least 1"),
        (["--logging_steps", "0"], "--logging_steps 0 must be at least 1"),
        (["--n_head", "3"], "--n_head 3 must divide --n_embd 128 (try --n_head 2 or 4)"),
        (["--data_bytes", "10"], "--data_bytes is too small: --block_size 128 cuts the 9 training bytes"),
        (["--block_size", "100000"], "--block_size is too large: --block_size 100000 cuts the 1800000 training bytes"),
        (["--max_steps", "0"], "--max_steps 0 must be at least 1"),
        (["--save_path", "/sys"], "--save_path /sys is not writable"),  # sysfs refuses files, even to root
        (["--save_steps", "5", "--ckpt_path", "/sys"], "--ckpt_path /sys is not writable"),
        (["--eval_batches", "100000"], "--eval_batches 100000 needs 800000 held-out sequences"),
        (["--dropout", "1.5"], "--dropout 1.5 must be at least 0 and below 1"),
        (["--learning_rate", "nan"], "--learning_rate nan must be a positive number"),
        (["--stop_at_step", "500"], "--stop_at_step 500 must be between 1 and --max_steps 400"),
        (["--save_steps", "0"], "--save_steps 0 must be -1 (never) or at least 1"),
        (["--max_norm", "inf"], "--max_norm inf must be a finite number >= 0"),
        (["--max_norm", "-1"], "--max_norm -1.0 must be a finite number >= 0"),
        (["--local_rank", "-2"], "--local_rank -2 must be at least -1"),
        (["--save_path", "{tmp}/a_file"], "--save_path {tmp}/a_file is a file, not a folder"),
        (
            ["--ckpt_path", "{tmp}/global_step4"],
            "--ckpt_path {tmp}/global_step4 is one checkpoint, not the folder of checkpoints: pass {tmp}",
        ),
    ],
)
def test_a_bad_example_flag_stops_at_parsing_naming_the_flag_and_a_fix(flags, message, capsys, monkeypatch, tmp_path):
    from train_example import parse_args

    (tmp_path / "a_file").write_text("")
    (tmp_path / "global_step4").mkdir()
    (tmp_path / "global_step4" / "checkpoint_complete.json").write_text("{}")  # one checkpoint's folder
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        parse_args([flag.format(tmp=tmp_path) for flag in flags])
    assert exit_info.value.code == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


def test_the_example_refuses_at_parsing_every_combination_of_flags_the_strategy_refuses(capsys, monkeypatch):
    from train_example import parse_args

    def refusal(flags):
        """What parse_args printed as it refused flags, or None where it took them."""
        try:
            parse_args(flags)
        except SystemExit:
            return capsys.readouterr().err
        return None

    for world_size, batch in (("1", 20), ("2", 24), ("2", 32)):  # 8 * 1 divides 20? no; 8 * 2 divides 24? no
        monkeypatch.setenv("WORLD_SIZE", world_size)
        refused, fits = refusal(["--train_batch_size", str(batch)]), batch % (8 * int(world_size)) == 0
        assert (refused is None) == fits, (world_size, batch, refused)
        assert fits or "must be a multiple of --micro_train_batch_size * ranks = 8 *" in refused
    monkeypatch.delenv("WORLD_SIZE")
    combinations = itertools.product(range(4), (False, True), (False, True), (None, "fp32", "bf16", "fp16"))
    for stage, adam_offload, bf16, accumulate in combinations:
        flags = ["--zero_stage", str(stage), *["--adam_offload"] * adam_offload, *["--bf16"] * bf16]
        flags += ["--grad_accum_dtype", accumulate] if accumulate else []
        strategy = partial(DeepspeedStrategy, zero_stage=stage, adam_offload=adam_offload, bf16=bf16)
        strategy_refuses = error_of(strategy, grad_accum_dtype=accumulate).startswith("ValueError")
        refused = refusal(flags)
        if strategy_refuses:
            assert refused and "needs --zero_stage 1, 2 or 3" in refused, flags
        else:
            assert refused is None, (flags, refused)
    # Refused before torch is imported: -X importtime lists every import.
    flags = ["--zero_stage", "0", "--adam_offload"]
    done = subprocess.run(
        [PYTHON, "-X", "importtime", "train_example.py", *flags], cwd=HERE, capture_output=True, text=True
    )
    assert done.returncode == 2 and "--adam_offload needs --zero_stage 1, 2 or 3" in done.stderr
    assert " torch" not in done.stderr and "deepspeed" not in done.stderr


def test_example_help_lists_every_default_and_answers_without_importing_torch():
    started = time.perf_counter()
    done = subprocess.run(
        [PYTHON, "-X", "importtime", "train_example.py", "--help"], cwd=HERE, capture_output=True, text=True
    )
    assert done.returncode == 0
    assert " torch" not in done.stderr and "deepspeed" not in done.stderr  # -X importtime lists every import
    for default in ("(default: 2)", "(default: 400)", "(default: ./ckpt)", "(default: 0.003)"):
        assert default in " ".join(done.stdout.split()), default
    print(f"--help answered in {time.perf_counter() - started:.2f} s")


def test_readme_shows_a_parser_with_local_rank_and_the_way_out_for_parsers_without_it():
    readme = open(os.path.join(HERE, "README.md")).read()
    usage = readme[readme.index("## Using it in your trainer") :]
    assert 'parser.add_argument("--local_rank", type=int, default=-1)' in usage
    assert "--no_local_rank" in usage


def test_unigram_baseline_is_the_cross_entropy_under_add_one_byte_frequencies():
    from train_example import unigram_loss

    train, val = torch.tensor(list(b"aab")), torch.tensor(list(b"ab"))
    expected = -(numpy.log(3 / 259) + numpy.log(2 / 259)) / 2  # a: (2 + 1) / (3 + 256), b: (1 + 1) / 259
    assert unigram_loss(train, val) == pytest.approx(expected, rel=1e-12)


@pytest.mark.full
def test_deepspeed_launcher_without_num_gpus_runs_one_cpu_process_that_learns_in_bf16(tmp_path):
    launcher = [PYTHON, DEEPSPEED, "--master_port", str(free_port())]
    flags = [*TINY, "--zero_stage", "2", "--bf16", "--ckpt_path", str(tmp_path)]  # not the repository's ckpt/
    assert_learns(run_example([*launcher, "train_example.py", *flags]), ranks=1)


@pytest.fixture(scope="module")
def plain_python_one_rank(example_dir):
    """SHARED in one process started by plain python, without a launcher."""
    return run_example([PYTHON, "train_example.py", *SHARED, *saved_to(example_dir, "one")])


@pytest.mark.full
def test_plain_python_runs_one_process_that_learns(plain_python_one_rank):
    assert_learns(plain_python_one_rank, ranks=1)


def test_deepspeed_launcher_with_two_processes_learns(deepspeed_two_ranks):
    assert_learns(deepspeed_two_ranks, ranks=2)


def metrics_of(ckpt):
    return [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]


def test_the_example_writes_one_json_line_per_logged_step_with_what_it_printed(deepspeed_two_ranks, example_dir):
    """Logged every step, evaluated every 4 (TINY): steps 0 (an evaluation alone) to 8, the last with both."""
    rows = metrics_of(example_dir / "ckpt_ds")
    assert [row["step"] for row in rows] == list(range(9)), rows
    fields = ["step", "train_loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "unigram_loss"]
    assert all(list(row) == fields for row in rows), rows
    trained = {row["step"]: row["train_loss"] for row in rows if row["train_loss"] is not None}
    assert {step: round(loss, 6) for step, loss in trained.items()} == losses(deepspeed_two_ranks, "train")
    held_out = {row["step"]: round(row["val_loss"], 6) for row in rows if row["val_loss"] is not None}
    assert held_out == losses(deepspeed_two_ranks, "held-out") and sorted(held_out) == [0, 4, 8]
    assert all(row["grad_norm"] > 0 and row["tokens_per_s"] > 0 and row["lr"] > 0 for row in rows[1:]), rows
    assert f"the logged figures: {example_dir / 'ckpt_ds' / 'metrics.jsonl'}" in deepspeed_two_ranks


def test_use_tensorboard_writes_the_same_figures_or_names_the_package_to_install(tmp_path, capsys, monkeypatch):
    from train_example import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    if importlib.util.find_spec("tensorboard") is None:  # requirements.txt does not install it
        with pytest.raises(SystemExit):
            parse_args(["--use_tensorboard", str(tmp_path)])
        error = capsys.readouterr().err
        assert "--use_tensorboard" in error and "needs the tensorboard package: pip install tensorboard" in error, error
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_example([PYTHON, "train_example.py", *TINY, "--ckpt_path", str(tmp_path), "--use_tensorboard", str(tmp_path)])
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    rows = metrics_of(tmp_path)
    assert [event.value for event in events.Scalars("train_loss")] == pytest.approx([r["train_loss"] for r in rows[1:]])
    assert [event.step for event in events.Scalars("val_loss")] == [0, 4, 8]


@pytest.mark.full
def test_the_final_held_out_loss_is_the_same_on_one_rank_as_on_two(plain_python_one_rank, deepspeed_two_ranks):
    """The same run configuration on 1 rank and on 2 evaluates the same held-out sequences; the weights differ
    only by float rounding (the gradients are summed in another order), so the figures agree closely."""
    final = [final_loss(output) for output in (plain_python_one_rank, deepspeed_two_ranks)]
    assert final[0] == pytest.approx(final[1], rel=1e-3), final


@pytest.fixture(scope="module")
def two_simulated_nodes(example_dir):
    """SHARED on two nodes of one rank each, simulated by two torchrun launches on this machine: each node's output.
    Both write to one checkpoint folder, as nodes do to a shared filesystem."""
    port, nodes = str(free_port()), []
    for node in (0, 1):
        cmd = [PYTHON, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node"]
        cmd += ["1", "--master_addr", "127.0.0.1", "--master_port", port, "train_example.py", *SHARED]
        nodes.append(started(cmd + saved_to(example_dir, "nodes"), ONE_THREAD))
    outputs = [node.communicate(timeout=180)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    return outputs


@pytest.mark.full
def test_two_nodes_simulated_with_torchrun_nnodes_train_like_one_node(two_simulated_nodes, deepspeed_two_ranks):
    assert_learns(two_simulated_nodes[0], ranks=2)  # rank 0, on node 0, logs
    assert losses(two_simulated_nodes[0], "held-out") == losses(deepspeed_two_ranks, "held-out")


@pytest.mark.full
def test_full_determinism_makes_a_second_run_save_byte_identical_weights(
    two_simulated_nodes, deepspeed_two_ranks, example_dir
):
    """The second run is the two simulated nodes' (another launcher, the same two ranks and flags)."""
    for noise in ("built successfully", "[INFO]", "[WARNING]", "No CUDA runtime"):  # quiet by default, every rank
        assert noise not in "".join(two_simulated_nodes), noise
    assert losses(two_simulated_nodes[0], "train") == losses(deepspeed_two_ranks, "train")
    assert weights(example_dir, "nodes") == weights(example_dir, "ds")


@pytest.fixture(scope="module")
def stopped_at_step_4(example_dir):
    """(its checkpoint folder, its output): the example under torchrun (2 ranks, ZeRO 3), stopped at step 4 of 8."""
    ckpt = str(example_dir / "ckpt_resume")
    return ckpt, run_example(torchrun("train_example.py", *SHARED, "--ckpt_path", ckpt, "--stop_at_step", "4"))


@pytest.mark.full
def test_stopping_with_a_checkpoint_and_resuming_matches_an_uninterrupted_run(
    deepspeed_two_ranks, example_dir, stopped_at_step_4
):
    ckpt, stopped = stopped_at_step_4
    assert "stopped at step 4 of 8" in stopped
    assert sorted(losses(stopped, "train")) == [1, 2, 3, 4]
    assert re.search(rf"checkpoint {re.escape(ckpt)}/global_step4: [\d.]+ MB in [\d.]+ s", stopped)  # a line a save
    os.remove(os.path.join(ckpt, "latest"))  # lost, with complete checkpoints beside it: never a fresh start
    flags = [*SHARED, "--ckpt_path", ckpt, "--load_checkpoint", "--save_path", str(example_dir / "weights_resumed")]
    resumed = run_example(torchrun("train_example.py", *flags))
    assert f"{ckpt} has no 'latest' file: resuming from its newest checkpoint, global_step4" in resumed
    assert "at step 4" in resumed
    assert losses(stopped, "train") | losses(resumed, "train") == losses(deepspeed_two_ranks, "train")
    assert weights(example_dir, "resumed") == weights(example_dir, "ds")
    # The metrics file: the stopped run's lines, then the resumed run's, as the uninterrupted run wrote them.
    rows, uninterrupted = metrics_of(Path(ckpt)), metrics_of(example_dir / "ckpt_ds")
    figures = ("step", "train_loss", "val_loss", "lr", "grad_norm")  # not tokens_per_s, a time
    assert [[row[f] for f in figures] for row in rows] == [[row[f] for f in figures] for row in uninterrupted]


@pytest.fixture(scope="module")
def resumed_on_one_rank_after_a_full_disk(stopped_at_step_4, example_dir, tmp_path_factory):
    """The checkpoint of the run stopped at step 4 (2 ranks, ZeRO 3) on a disk with room for half a checkpoint,
    resumed by plain python at ZeRO 2, whose save at step 8 fails; then the same command once there is room.
    Returns ((return code, output) of the first, or None where no disk could be mounted, the output of the
    second)."""
    with small_disk(tmp_path_factory.mktemp("full_disk") / "disk") as disk:
        ckpt = disk / "ckpt"
        shutil.copytree(os.path.join(stopped_at_step_4[0], "global_step4"), ckpt / "global_step4")
        (ckpt / "latest").write_text("global_step4")
        # Without --full_determinism: under deterministic algorithms torch.empty fills what it allocates with NaN,
        # and at ZeRO 1 and 2 DeepSpeed allocates 2 GB gradient buckets each micro-step (4 steps: 19 s, not 0.1 s).
        flags = [*TINY, "--zero_stage", "2", "--save_steps", "4", "--ckpt_path", str(ckpt), "--load_checkpoint"]
        command = [PYTHON, "train_example.py", *flags, "--save_path", str(example_dir / "weights_reshaped")]
        failed = None
        if os.path.ismount(disk):
            filler = disk / "filler"
            filler.write_bytes(bytes(shutil.disk_usage(disk).free - folder_bytes(ckpt / "global_step4") // 2))
            failed = launch(command, 180, env=ONE_THREAD)  # with room for half a checkpoint
            filler.unlink()
        return failed, run_example(command)


@pytest.mark.full
def test_a_save_that_fails_stops_the_example_saying_why_and_the_same_command_resumes_once_there_is_room(
    resumed_on_one_rank_after_a_full_disk,
):
    failed, resumed = resumed_on_one_rank_after_a_full_disk
    if failed is None:
        pytest.skip("a full disk needs a tmpfs, which needs root")
    returncode, failed = failed
    assert returncode == 1 and "Traceback" not in failed, failed[-3000:]
    assert "stopped at step 8: save_ckpt failed on rank 0 " in failed and " MiB free" in failed, failed[-3000:]
    assert "rerun with --load_checkpoint" in failed
    assert "resumed from" in resumed and "at step 4" in resumed and "final held-out loss" in resumed


@pytest.mark.full
def test_a_run_stopped_on_two_ranks_at_zero_3_continues_on_one_rank_at_zero_2_within_rounding(
    resumed_on_one_rank_after_a_full_disk, example_dir, deepspeed_two_ranks
):
    """The checkpoint of the run stopped at step 4 (2 ranks, ZeRO 3) resumed by plain python at ZeRO 2."""
    _, resumed = resumed_on_one_rank_after_a_full_disk
    assert "1 ranks x" in resumed and "at step 4" in resumed
    assert sorted(losses(resumed, "train")) == [5, 6, 7, 8]
    uninterrupted = torch.load(example_dir / "weights_ds" / "pytorch_model.bin", weights_only=True)
    got = torch.load(example_dir / "weights_reshaped" / "pytorch_model.bin", weights_only=True)
    assert got.keys() == uninterrupted.keys()
    # Another shape sums the gradients in another order: float rounding, far below the 4 steps' movement.
    moved = max((got[k] - uninterrupted[k]).abs().max().item() for k in got)
    assert moved < 1e-4, moved


def followed(command, until, act):
    """Start command, read its output line by line and call act(process) at the first line for which until(line,
    lines so far) holds; returns (the process, when it has ended, and its whole output)."""
    run, seen = started(command, ONE_THREAD), []
    for line in run.stdout:
        seen.append(line)
        if until(line, seen):
            act(run)
            break
    return run, "".join(seen) + run.communicate(timeout=300)[0]


def kill_a_worker(signum):
    """What act(run) does to send signum to the last worker a launcher started: one rank alone."""

    def act(run):
        with open(f"/proc/{run.pid}/task/{run.pid}/children") as f:
            os.kill(int(f.read().split()[-1]), signum)

    return act


@pytest.mark.full
def test_a_signal_to_one_rank_stops_every_rank_at_a_checkpoint_and_the_same_command_continues_exactly(
    deepspeed_two_ranks, example_dir
):
    """With --background_save: the checkpoints at step 4 and at the signal are written while training goes on, the
    last one finished by teardown() before the process exits."""
    command = torchrun("train_example.py", *SHARED, "--ckpt_path", str(example_dir / "ckpt_preempted"))
    command += ["--load_checkpoint", "--background_save"]
    # At step 2, SIGTERM to one worker alone, as a scheduler's may arrive.
    run, output = followed(command, lambda line, _: "step     2 | train loss" in line, kill_a_worker(signal.SIGTERM))
    stopped = re.search(r"stopped by signal 15 at step (\d+)", output)
    assert stopped, output[-3000:]
    assert re.search(r"exitcode\s*:\s*143", output), output[-3000:]  # 128 + SIGTERM, reported by torchrun
    step = int(stopped.group(1))
    assert (example_dir / "ckpt_preempted" / f"global_step{step}" / "checkpoint_complete.json").is_file()
    assert re.search(rf"checkpoint global_step{step}: training stopped [\d.]+ s, written in the background", output)
    resumed = run_example(command + ["--save_path", str(example_dir / "weights_preempted")])
    assert f"at step {step}" in resumed
    assert losses(output, "train") | losses(resumed, "train") == losses(deepspeed_two_ranks, "train")
    assert weights(example_dir, "preempted") == weights(example_dir, "ds")


@pytest.mark.full
def test_torchrun_restarts_a_run_whose_rank_was_killed_and_it_ends_exactly_like_an_uninterrupted_one(
    deepspeed_two_ranks, example_dir
):
    command = torchrun("train_example.py", *SHARED, *saved_to(example_dir, "restarted"), "--load_checkpoint")
    command[3:3] = ["--max_restarts", "1"]  # torchrun's own flag, before the script

    def after_the_checkpoint_at_4(line, seen):
        return "step     5 | train loss" in line and not any("resumed" in s for s in seen)

    run, output = followed(command, after_the_checkpoint_at_4, kill_a_worker(signal.SIGKILL))
    assert run.returncode == 0, output[-3000:]
    assert "resumed from" in output and "at step 4" in output, output[-3000:]
    assert weights(example_dir, "restarted") == weights(example_dir, "ds")


@pytest.mark.full
def test_zero3_weights_load_into_plain_torch_and_give_the_reported_held_out_loss(deepspeed_two_ranks, example_dir):
    from train_example import ByteChunks, byte_loss, load_corpus, model_from_args, parse_args, split_corpus

    args = parse_args([*SHARED])
    model = model_from_args(args)
    model.load_state_dict(torch.load(example_dir / "weights_ds" / "pytorch_model.bin", weights_only=True))
    _, val = split_corpus(load_corpus(args.data_bytes), args.val_fraction)
    # An evaluation reads the held-out set's first eval_batches micro-batches, shared out over the ranks.
    count = args.eval_batches * args.micro_train_batch_size
    x, y = (torch.stack(t) for t in zip(*[ByteChunks(val, args.block_size)[i] for i in range(count)], strict=True))
    with torch.no_grad():
        plain_loss = byte_loss(model, x, y).item()
    assert plain_loss == pytest.approx(final_loss(deepspeed_two_ranks), abs=2e-6)


# =============================================================================================================
# A step counts optimizer steps, whatever the batch (issue 39 i)


@pytest.mark.full
def test_a_run_resumed_on_three_ranks_with_the_default_batch_saves_where_it_says_and_follows_its_schedule(
    tmp_path,
):
    """Two ranks take the default batch 32, three take 36 (32 rounded up to whole micro-steps of 2 x 3): a step is
    an optimizer step in both, so the resumed run goes on from step 4, saves global_step<step> and its learning rate
    at each step is the schedule's at that step."""
    default_batch = [flag for flag in TINY if flag != "--train_batch_size"]
    default_batch.remove("8")  # --train_batch_size's value; no other flag of TINY is 8
    flags = [*default_batch, "--zero_stage", "2", "--ckpt_path", str(tmp_path / "ckpt")]
    run_example(torchrun("train_example.py", *flags, "--stop_at_step", "4", ranks=2))
    resumed = run_example(torchrun("train_example.py", *flags, "--load_checkpoint", "--save_steps", "2", ranks=3))
    assert "3 ranks x 6 accumulation steps" in resumed and "at step 4" in resumed, resumed[-3000:]
    assert sorted(losses(resumed, "train")) == [5, 6, 7, 8]
    assert "final held-out loss" in resumed
    saved = re.findall(r"step +(\d+) \| checkpoint (\S+): ", resumed)
    assert [step for step, _ in saved] == ["6", "8"], saved
    for step, folder in saved:
        assert folder == str(tmp_path / "ckpt" / f"global_step{step}")
        assert os.path.isfile(os.path.join(folder, "checkpoint_complete.json")), folder

    # The schedule by hand, from TINY's flags: peak 1e-2, 2 warmup steps, cosine to 0.1 x peak at step 8.
    def lr_after(step):
        progress = (step - 2) / (8 - 2)
        return 1e-2 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    logged = re.findall(r"step +(\d+) \| train loss [\d.]+ \| lr ([\d.e+-]+)", resumed)
    assert [int(step) for step, _ in logged] == [5, 6, 7, 8]
    for step, lr in logged:
        assert float(lr) == pytest.approx(lr_after(int(step)), rel=1e-3), (step, lr)  # printed to 4 digits


def test_the_example_resumed_with_another_batch_goes_on_at_the_same_sample_and_resumes_again_exactly():
    """Ten samples, one rank: 3 steps of 4, then (a resume) 1 step of 6, then (another resume) 2 steps of 6. Each
    epoch is cut to whole steps of the batch it is trained with; the order is torch's seeded permutation of the
    epoch, computed here by hand."""
    from train_example import micro_batches

    dataset = torch.utils.data.TensorDataset(torch.arange(10))

    def steps(batch, count, position=None):
        """The samples of count steps of batch (micro-batches of 2) from position; and the position after them."""
        loader = DeepspeedStrategy(zero_stage=0, seed=42).setup_dataloader(dataset, 2)  # no process group: one rank
        if position is not None:
            loader.load_state_dict(position)
        batches = micro_batches(loader, types.SimpleNamespace(train_batch_size=batch, accumulated_gradient=batch // 2))
        taken = [torch.cat([next(batches)[0] for _ in range(batch // 2)]).tolist() for _ in range(count)]
        return taken, loader.state_dict()

    def epoch(e):
        return torch.randperm(10, generator=torch.Generator().manual_seed(42 + e)).tolist()

    first, position = steps(4, 3)
    assert first == [epoch(0)[0:4], epoch(0)[4:8], epoch(1)[0:4]]  # epoch 0 holds two steps of 4
    second, position = steps(6, 1, position)
    assert second == [epoch(1)[4:10]]  # on at the same sample: one step of 6 fits in what epoch 1 has left
    third, _ = steps(6, 2, position)
    assert third == [epoch(2)[0:6], epoch(3)[0:6]]  # epoch 2 holds one step of 6
    uninterrupted, _ = steps(6, 3, steps(4, 3)[1])
    assert second + third == uninterrupted


# =============================================================================================================
# The example on a GPU: pinned batches, copied without blocking, and no host sync per step (issue 38 item 7)


@pytest.mark.usefixtures("clean_launch_env")
def test_the_preemption_check_answers_with_the_previous_steps_reduction_so_the_host_never_waits_for_the_step_under_way():
    """Reading the reduction a call starts would make the host wait for the device to finish the step just queued;
    reading the previous call's does not. So a signal (SIGUSR1 here, like SIGTERM) is answered one call later, on
    every rank alike, and stays set."""
    from train_example import Preemption

    strategy = get_strategy(argparse.Namespace(zero_stage=0, train_batch_size=1))
    strategy.setup_distributed()
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)  # where it lands if the example does not listen
    try:
        preemption = Preemption(strategy)
        assert preemption.received() == 0
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.received() == 0  # the reduction it answers with was started before the signal
        assert preemption.received() == signal.SIGUSR1
        assert preemption.received() == signal.SIGUSR1  # it stays set
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


class LoaderSetUp(Exception):
    """Raised to end main() once its train loader is set up."""


class NamedAccelerator:
    """DeepSpeed's accelerator under another name: the name alone changes, every call goes to the real one."""

    def __init__(self, accelerator, name):
        self.accelerator, self.name = accelerator, name

    def device_name(self, device_index=None):
        return self.name

    def __getattr__(self, attribute):
        return getattr(self.accelerator, attribute)


class CopyRecorder(torch.Tensor):
    """A batch tensor that notes the non_blocking of each copy made of it."""

    copies = []

    def to(self, *args, **kwargs):
        CopyRecorder.copies.append(kwargs.get("non_blocking", False))
        return super().to(*args, **kwargs).as_subclass(torch.Tensor)


def run_example_in_process(accelerator_name, stop_at_loader, ckpt):
    """main() of train_example.py on TINY for 2 steps in this process, its checkpoints and figures in ckpt; returns
    the pin_memory it passed for the train loader. Every batch the loader yields records its copies in
    CopyRecorder.copies. accelerator_name is what the example (only it) is told the accelerator is called;
    stop_at_loader ends the run once the loader is set up, so that a name that is not this machine's trains
    nothing."""
    import train_example

    pinned = []
    setup_dataloader = DeepspeedStrategy.setup_dataloader
    loader_iter = get_strategy_module.StatefulDataLoader.__iter__

    def recorded_setup_dataloader(self, *args, **kwargs):
        pinned.append(kwargs.get("pin_memory", False))
        if stop_at_loader:
            raise LoaderSetUp()
        return setup_dataloader(self, *args, **kwargs)

    def recording_iter(self):
        for batch in loader_iter(self):
            yield [tensor.as_subclass(CopyRecorder) for tensor in batch]

    CopyRecorder.copies = []
    flags = ["--zero_stage", "0", "--max_steps", "2", "--eval_steps", "2", "--ckpt_path", str(ckpt)]
    args = train_example.parse_args([*TINY, *flags])
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    with pytest.MonkeyPatch.context() as patch:
        named = NamedAccelerator(train_example.get_accelerator(), accelerator_name)
        patch.setattr(train_example, "get_accelerator", lambda: named)
        patch.setattr(DeepspeedStrategy, "setup_dataloader", recorded_setup_dataloader)
        patch.setattr(get_strategy_module.StatefulDataLoader, "__iter__", recording_iter)
        # The process group stays, as after every in-process case here: DeepSpeed keeps the groups of the first.
        patch.setattr(DeepspeedStrategy, "teardown", lambda self: None)
        try:
            train_example.main(args)
        except LoaderSetUp:
            pass
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
    return pinned[0]


@pytest.mark.usefixtures("clean_launch_env")
def test_the_example_pins_its_batches_only_off_the_cpu_and_copies_each_without_blocking(tmp_path):
    """Pinned memory lets a copy to an accelerator run while the host goes on; on a machine without one torch warns
    that it pins nothing. Told its accelerator is a GPU, the example asks for pinned memory (it stops there: this
    machine trains on its CPU); on the CPU it does not, trains without a warning about it, and copies every
    micro-batch with non_blocking. It writes into its own folder: the repository's ckpt/, where the README's first
    command keeps its figures, stays as it was."""
    ours = os.path.join(HERE, "ckpt")

    def listing():  # {name: modification time} of the repository's ckpt/
        return {e.name: e.stat().st_mtime_ns for e in os.scandir(ours)} if os.path.isdir(ours) else None

    before = listing()
    assert run_example_in_process("cuda", stop_at_loader=True, ckpt=tmp_path / "cuda") is True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run_example_in_process("cpu", stop_at_loader=False, ckpt=tmp_path / "cpu") is False
    assert not [w for w in caught if "pin_memory" in str(w.message)], [str(w.message) for w in caught]
    # 2 steps x 4 micro-batches (TINY: 8 sequences a step, 2 per micro-batch, one rank), an input and a target each
    assert CopyRecorder.copies == [True] * 16, CopyRecorder.copies
    assert listing() == before, (before, listing())


# =============================================================================================================
# Benchmarks: each one at its smallest setting, so none stops running unnoticed. Their figures come from their
# full settings (benchmarks/README.md); here only that each runs and prints them.

BENCHMARKS = {  # name: (its smallest setting, a line of its figures)
    "overhead": (["--repeats", "1", "--steps", "1", "--startup_repeats", "0"], r"ratio strategy / raw: median \d"),
    "memory_by_stage": (["--n_layer", "1", "--n_embd", "48"], r"\nbf16\s+3\s+\d+\.\d+ / "),
    "example_throughput": (["--stages", "0", "--dtypes", "fp32", "--steps", "2"], r"\n\s+0\s+[\d,]+\n"),
    "reshape_load": (
        ["--layers", "1", "--width", "64", "--repeats", "1"],
        r"load_ckpt ZeRO 3 / DeepSpeed's own load = \d",
    ),
    "save_cost": (
        ["--layers", "1", "--width", "256", "--repeats", "2", "--steps", "2"],
        r"added to the run, background",
    ),
    "first_command": (["--variants", "--max_steps 2 --eval_steps 1 --eval_batches 1"], r"\| 2 \| [\d,]+ \| \d+ \| \d"),
    "gpu_check": (["--out", os.devnull], r"checks: \d+ ok, \d+ skipped, 0 failed"),  # on a CPU: the smallest sizes
    "determinism_cost": (
        ["--steps", "2", "--repeats", "1", "--tiny", "--variants", "normal", "deterministic"],
        r"deterministic / normal: \d",
    ),
}


@pytest.mark.full
@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_each_benchmark_runs_at_its_smallest_setting_and_prints_its_figures(name, tmp_path):
    flags, figures = BENCHMARKS[name]
    script = os.path.join("benchmarks", f"{name}.py")
    if name == "memory_by_stage":  # started under torchrun, as its docstring says
        cmd = torchrun(script, *flags)
    else:
        cmd = [PYTHON, script, *flags] + (["--dir", str(tmp_path / "ckpt")] if "--layers" in flags else [])
    returncode, output = launch(cmd, timeout=300, env={"OMP_NUM_THREADS": "1"})
    assert returncode == 0, output[-3000:]
    assert re.search(figures, output), output[-3000:]


@pytest.mark.full
def test_at_8_ranks_each_rank_opens_only_its_share_of_a_checkpoints_files_as_strace_counts_them(tmp_path):
    """benchmarks/load_opens.py (not in BENCHMARKS: this test runs it) traces every openat of each of 8 ranks'
    processes, Python's, torch's and DeepSpeed's, while they load a ZeRO 2 and a ZeRO 3 checkpoint in the saving
    run's shape; release 0.20.0 opened all of them on every rank (18 of 18, 25 of 25). Loads in other shapes and
    on 4 ranks run too, and must succeed."""
    figures = tmp_path / "opens.json"
    returncode, output = launch([PYTHON, "benchmarks/load_opens.py", "--json", str(figures)], timeout=600)
    assert returncode == 0, output[-5000:]
    opened = json.loads(figures.read_text())
    assert len(opened) == 8, sorted(opened)  # every load of the three launches, traced
    for stage in (2, 3):
        got = opened[f"load_ckpt zero{stage} -> zero{stage} on 8"]
        assert got["most"] <= math.ceil(got["files"] / 8) + 6, got
        assert got["most"] <= opened[f"deepspeed zero{stage} -> zero{stage} on 8"]["most"] + 6, got


# =============================================================================================================
# load_ckpt under review: each case is a way a real caller once got a crash or a silent wrong result. In the core
# launch (two ranks): a ZeRO 2 run of ReshapeModel saves after 2 steps, keeping DeepSpeed's own view of its
# state as the reference (the fp32 masters and optimizer state through DeepSpeed's getters, and state_dict());
# each case resumes it into another engine and compares.

REVIEW_TARGETS = {  # every optimizer class DeepSpeed 0.19.8 builds for the flags: (stage, flags, its class)
    "zero0_fp32": (0, {}, "AdamW"),
    "zero0_bf16": (0, {"bf16": True}, "FP16_UnfusedOptimizer"),
    "zero1_bf16_fp32_accum": (1, {"bf16": True, "grad_accum_dtype": "fp32"}, "BF16_Optimizer"),
    "zero1_bf16": (1, {"bf16": True}, "DeepSpeedZeroOptimizer"),
    "zero2_offload": (2, {"adam_offload": True}, "DeepSpeedZeroOptimizer"),
    "zero3_bf16": (3, {"bf16": True}, "DeepSpeedZeroOptimizer_Stage3"),
    "zero3_offload": (3, {"adam_offload": True}, "DeepSpeedZeroOptimizer_Stage3"),
}


class ReshapeModelChanged(ReshapeModel):
    """ReshapeModel with one output more (out's shapes change) and a parameter the checkpoint lacks."""

    def __init__(self, init_seed=1234):
        super().__init__(init_seed)
        self.out = torch.nn.Linear(RESHAPE_WIDTH, OUTPUTS + 1)
        self.extra = torch.nn.Parameter(torch.randn(3))


def review_case(core_run, name):
    """Rank 0's result of the review's case name, and the state the review's ZeRO 2 run saved."""
    return case(core_run, name)[0], case(core_run, "saved")[0]


def assert_same_state(got, expected, names=None, dtype=torch.float32):
    """Every tensor of expected (by name, or only names) equals got's exactly, or after rounding to dtype."""
    for name in expected if names is None else names:
        assert name in got, name
        for key, value in expected[name].items() if isinstance(expected[name], dict) else [(None, expected[name])]:
            loaded = got[name][key] if key is not None else got[name]
            rounded = value.to(dtype).float()  # a weight in the engine's dtype; a buffer may stay in fp32
            assert torch.equal(loaded, rounded) or torch.equal(loaded, value), (name, key, (loaded - value).abs().max())


@pytest.mark.full
def test_every_optimizer_class_deepspeed_builds_for_accepted_flags_is_one_the_reader_writes_into(core_run):
    import get_strategy as gs

    built, _ = review_case(core_run, "classes")  # (stage, bf16, grad_accum_dtype, adam_offload) -> class or error
    assert not [(flags, kind) for flags, kind in built.items() if kind.startswith("error")], built
    assert set(built.values()) == {"AdamW", *gs.WRAPPERS}  # the reader's table, no more, no less
    assert set(built.values()) == {kind for _, _, kind in REVIEW_TARGETS.values()}  # each resumed into below


@pytest.mark.full
@pytest.mark.parametrize("name", REVIEW_TARGETS)
def test_a_zero_2_checkpoint_resumes_into_every_optimizer_class_with_the_saved_masters_and_moments(core_run, name):
    got, saved = review_case(core_run, f"target_{name}")
    assert got["kind"] == REVIEW_TARGETS[name][2]
    assert_same_state(got["optimizer"], saved["optimizer"])  # fp32 masters and moments, exactly
    assert_same_state(got["tensors"], saved["tensors"], dtype=got["dtype"])  # weights, frozen layer, buffer
    assert got["step"] == 2 and got["stepped"]  # and the next step runs


@pytest.mark.full
@pytest.mark.parametrize("stage", [2, 1])
def test_a_layer_frozen_after_a_warm_start_gets_the_checkpoints_weights(core_run, stage):
    got, saved = review_case(core_run, f"frozen_{stage}")
    assert not got["first_trains"]
    assert_same_state(got["tensors"], saved["tensors"])


@pytest.mark.full
def test_a_frozen_parameter_a_user_optimizer_lists_resumes_at_zero_3(core_run):
    got, saved = review_case(core_run, "frozen_listed")
    assert_same_state(got["tensors"], got["saved_tensors"])
    assert_same_state(got["optimizer"], got["saved_optimizer"])


@pytest.mark.full
@pytest.mark.parametrize("stage", [2, 3])
def test_without_strict_loading_what_matches_by_name_and_shape_loads_and_the_rest_keeps_its_values(core_run, stage):
    got, saved = review_case(core_run, f"not_strict_{stage}")
    changed = ["out.weight", "out.bias", "extra"]
    assert_same_state(got["tensors"], saved["tensors"], names=[n for n in saved["tensors"] if n not in changed])
    assert_same_state(got["tensors"], got["initial"], names=changed)  # as initialised, never scrambled
    assert "kept as they were: ['extra', 'out.bias', 'out.weight']" in got["printed"], got["printed"]
    assert "not loaded: ['out.bias', 'out.weight']" in got["printed"], got["printed"]


@pytest.mark.full
@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("module_only", [True, False])
def test_an_eval_engine_loads_a_training_checkpoints_weights(core_run, stage, module_only):
    got, saved = review_case(core_run, f"eval_{stage}_{module_only}")
    assert got["stage"] == stage
    assert_same_state(got["tensors"], saved["tensors"])


@pytest.mark.full
def test_a_plain_deepspeed_checkpoint_is_refused_naming_the_way_in_which_then_resumes_it_in_another_shape(core_run):
    got, _ = review_case(core_run, "plain")
    for on_rank in case(core_run, "plain"):
        for refused in (on_rank["same_shape"], on_rank["other_shape"]):
            assert refused.startswith("ValueError: checkpoint ") and "(a plain DeepSpeed checkpoint, or" in refused, (
                refused
            )
            assert "engine.load_checkpoint(load_dir, tag) in the shape that saved it" in refused, refused
    assert_same_state(got["optimizer"], got["saved_optimizer"])  # through DeepSpeed's load, save_ckpt, ZeRO 3
    assert_same_state(got["tensors"], got["saved_tensors"])
    assert got["global_steps"] == 2


@pytest.mark.full
def test_amsgrads_state_resumes_in_another_shape_and_an_optimizer_without_it_is_refused_unchanged(core_run):
    got, _ = review_case(core_run, "amsgrad")
    assert "max_exp_avg_sq" in got["saved_optimizer"]["first.weight"]
    assert_same_state(got["optimizer"], got["saved_optimizer"])
    assert got["stepped"]
    for on_rank in case(core_run, "amsgrad"):
        refused = on_rank["offload"]
        assert "max_exp_avg_sq" in refused and "DeepSpeedCPUAdam" in refused, refused
    assert_same_state(got["offload_after"], got["offload_before"])  # the refusal changed nothing


@pytest.mark.full
def test_optimizer_groups_in_another_order_or_another_grouping_are_refused_naming_both(core_run):
    for on_rank in case(core_run, "groups"):
        for refused in (on_rank["reversed"], on_rank["one_group"]):
            assert "optimizer groups do not match" in refused and "saved [[" in refused and "here [[" in refused


@pytest.mark.full
def test_a_file_copied_in_from_another_checkpoint_or_a_damaged_record_is_named_and_latest_falls_back(core_run):
    got, _ = review_case(core_run, "integrity")
    assert got["same_size"]  # so only the record's contents can tell the files apart
    for on_rank in case(core_run, "integrity"):
        copied = on_rank["copied"]
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt is not the file this checkpoint saved" in copied, copied
    assert got["latest_missing"] == 3 and "resuming from global_step3 instead" in got["latest_missing_printed"]
    assert got["record_damaged"] == 2
    assert "checkpoint_complete.json is damaged" in got["record_damaged_printed"]
    assert got["record_a_list"] == 2 and "checkpoint_complete.json is damaged" in got["record_a_list_printed"], got
    assert got["saved_after_a_list"] == "no error", got


def optimizer_snapshot(engine):
    """Each trained parameter's fp32 master ("value") and optimizer state by name, as float32 CPU copies: through
    DeepSpeed's public getters at ZeRO 1-3, and at ZeRO 0, where they return None, from the optimizer's own
    tensors. All ranks must call it."""
    optimizer = engine.optimizer
    base = getattr(optimizer, "optimizer", optimizer)
    names = {id(p): name for name, p in engine.module.named_parameters()}
    snapshot = {}
    if engine.zero_optimization_stage() == 0:
        masters = getattr(optimizer, "fp32_groups", [group["params"] for group in optimizer.param_groups])
        for params, copies in zip(getattr(optimizer, "fp16_groups", masters), masters):
            for p, master in zip(params, copies):
                state = {key: value for key, value in base.state.get(master, {}).items() if key != "step"}
                snapshot[names[id(p)]] = {
                    key: t.detach().float().cpu().clone() for key, t in {"value": master, **state}.items()
                }
        return snapshot
    if hasattr(optimizer, "_hp_optimizer_states_linked"):  # ZeRO 1 and 2, BF16_Optimizer
        # DeepSpeed links each parameter to its optimizer state once, after its first group's first step, when
        # the other groups have no state yet (so their getters raise): link them again, with DeepSpeed's own code.
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()
    amsgrad = any(group.get("amsgrad") for group in base.param_groups)
    keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            snapshot[name] = {"value": safe_get_full_fp32_param(p).float().cpu()}
            if any(base.state.values()):  # after the first step, or a load
                snapshot[name].update((key, safe_get_full_optimizer_state(p, key).float().cpu()) for key in keys)
    return snapshot


def review_save(ckpt, stage=2, plain=False, **engine_kwargs):
    """2 steps of ReshapeModel at ZeRO stage, saved to ckpt; returns the state DeepSpeed reports."""
    strategy = reshape_strategy(stage)
    engine, optimizer, scheduler = reshape_engine(strategy, 1234, **engine_kwargs)
    reshape_train(strategy, engine, optimizer, scheduler, 2)
    if plain:  # DeepSpeed's own save, as OpenRLHF's strategy calls it: latest and global_step2/, no record
        engine.save_checkpoint(ckpt)
    else:
        strategy.save_ckpt(engine, ckpt, client_state={"consumed_samples": 2 * RESHAPE_TRAIN})
    return dict(tensors=full_state(engine), optimizer=optimizer_snapshot(engine))


def load_printing(strategy, engine, ckpt, **kwargs):
    """load_ckpt, returning what rank 0 printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        strategy.load_ckpt(engine, ckpt, **kwargs)
    return printed.getvalue()


def on_rank_0(action, *args):
    """action(*args) on rank 0 alone, between barriers: every rank sees the files as they were before, then after."""
    dist.barrier()
    if dist.get_rank() == 0:
        action(*args)
    dist.barrier()


def error_of(function, *args, **kwargs):
    try:
        function(*args, **kwargs)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def review_classes():
    """The optimizer class DeepSpeed builds for every combination of flags the constructor accepts."""
    classes = {}
    for stage, bf16, accumulate, offload in itertools.product(
        range(4), (False, True), (None, "fp32", "bf16", "fp16"), (False, True)
    ):
        try:
            strategy = reshape_strategy(stage, bf16=bf16, grad_accum_dtype=accumulate, adam_offload=offload)
        except ValueError:  # refused by the constructor: not a configuration to resume into
            continue
        model = torch.nn.Linear(4, 4)
        try:
            engine, *_ = strategy.prepare((model, strategy.create_optimizer(model, lr=LR), None))
            classes[stage, bf16, accumulate, offload] = type(engine.optimizer).__name__
        except Exception as error:
            classes[stage, bf16, accumulate, offload] = f"error {error!r}"
    return classes


def review_integrity(rank, ckpt):
    strategy = reshape_strategy(2)
    engine, optimizer, scheduler = reshape_engine(strategy, 1234)
    loader = iter(strategy.setup_dataloader(make_dataset(), MICRO, shuffle=False))
    for _ in range(3):
        train(strategy, engine, optimizer, scheduler, loader, 1)
        strategy.save_ckpt(engine, ckpt)  # global_step1, 2 and 3
    shard = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    newest, older = os.path.join(ckpt, "global_step3", shard), os.path.join(ckpt, "global_step2", shard)
    got = dict(same_size=os.path.getsize(newest) == os.path.getsize(older))
    if rank == 0:
        shutil.copy(newest, newest + ".kept")
        shutil.copy(older, newest)
    dist.barrier()
    got["copied"] = error_of(strategy.load_ckpt, engine, ckpt, tag="global_step3")
    dist.barrier()
    if rank == 0:
        os.replace(newest + ".kept", newest)
        Path(ckpt, "latest").write_text("global_step99")
    dist.barrier()
    got["latest_missing_printed"] = load_printing(strategy, engine, ckpt)
    got["latest_missing"] = engine.global_steps
    dist.barrier()
    if rank == 0:  # one digit of the record's first file size changed: still valid JSON
        Path(ckpt, "latest").write_text("global_step3")
        record = os.path.join(ckpt, "global_step3", "checkpoint_complete.json")
        text = Path(record).read_text()
        at = text.index('"files"') + text[text.index('"files"') :].index(": ", 10) + 2
        Path(record).write_text(text[:at] + ("1" if text[at] != "1" else "2") + text[at + 1 :])
    dist.barrier()
    got["record_damaged_printed"] = load_printing(strategy, engine, ckpt)
    got["record_damaged"] = engine.global_steps
    dist.barrier()
    if rank == 0:  # JSON, but not a record's shape: damaged too, not an error in every later save and load
        Path(ckpt, "global_step3", "checkpoint_complete.json").write_text("[]")
    dist.barrier()
    got["record_a_list_printed"] = load_printing(strategy, engine, ckpt)
    got["record_a_list"] = engine.global_steps
    got["saved_after_a_list"] = error_of(strategy.save_ckpt, engine, ckpt, tag="after")
    return got


def review_target(z2, name):
    stage, flags, _ = REVIEW_TARGETS[name]
    strategy = reshape_strategy(stage, **flags)
    engine, optimizer, scheduler = reshape_engine(strategy, 999)
    _, client_state = strategy.load_ckpt(engine, z2)
    got = dict(kind=type(engine.optimizer).__name__, optimizer=optimizer_snapshot(engine), tensors=full_state(engine))
    got.update(dtype=next(engine.module.parameters()).dtype, step=engine.global_steps)
    reshape_train(strategy, engine, optimizer, scheduler, 1, client_state["consumed_samples"])
    return dict(got, stepped=engine.global_steps == 3)


def review_frozen(z2, stage):
    """Warm-started from the checkpoint, then the first layer frozen."""
    strategy = reshape_strategy(stage)
    engine, _, _ = reshape_engine(strategy, 999, freeze=("first",))
    strategy.load_ckpt(engine, z2, load_module_only=True)
    return dict(tensors=full_state(engine), first_trains=engine.module.first.weight.requires_grad)


def review_frozen_listed(out):
    listed = review_save(os.path.join(out, "listed"), groups="all")
    strategy = reshape_strategy(3)
    engine, _, _ = reshape_engine(strategy, 999, groups="all")
    strategy.load_ckpt(engine, os.path.join(out, "listed"))
    got = dict(tensors=full_state(engine), optimizer=optimizer_snapshot(engine))
    return dict(got, saved_tensors=listed["tensors"], saved_optimizer=listed["optimizer"])


def review_not_strict(z2, stage):
    strategy = reshape_strategy(stage)
    engine, _, _ = reshape_engine(strategy, 999, model_class=ReshapeModelChanged)
    initial = full_state(engine)
    printed = load_printing(strategy, engine, z2, load_module_strict=False)
    return dict(tensors=full_state(engine), initial=initial, printed=printed)


def review_eval(z2, stage, module_only):
    strategy = reshape_strategy(stage)  # its eval engines: stage 0 when training uses 2, 3 when it uses 3
    engine = strategy.prepare(ReshapeModel(999))
    strategy.load_ckpt(engine, z2, load_module_only=module_only)
    return dict(stage=engine.zero_optimization_stage(), tensors=full_state(engine))


def review_plain(out):
    """A plain DeepSpeed checkpoint (OpenRLHF's strategy saves them) is refused in its own shape and in another,
    naming the way in, which then works: DeepSpeed's own load, save_ckpt, and load_ckpt in another shape."""
    plain = review_save(os.path.join(out, "plain"), plain=True)
    strategy = reshape_strategy(2)
    engine, _, _ = reshape_engine(strategy, 999)
    got = dict(same_shape=error_of(strategy.load_ckpt, engine, os.path.join(out, "plain")))
    engine.load_checkpoint(os.path.join(out, "plain"))
    strategy.save_ckpt(engine, os.path.join(out, "plain_moved"), client_state={"consumed_samples": 2 * RESHAPE_TRAIN})
    strategy = reshape_strategy(3)
    engine, _, _ = reshape_engine(strategy, 999)
    got["other_shape"] = error_of(strategy.load_ckpt, engine, os.path.join(out, "plain"))
    strategy.load_ckpt(engine, os.path.join(out, "plain_moved"))
    got.update(tensors=full_state(engine), optimizer=optimizer_snapshot(engine), global_steps=engine.global_steps)
    return dict(got, saved_tensors=plain["tensors"], saved_optimizer=plain["optimizer"])


def review_amsgrad(out):
    ams = review_save(os.path.join(out, "ams"), amsgrad=True)
    strategy = reshape_strategy(3)
    engine, optimizer, scheduler = reshape_engine(strategy, 999, amsgrad=True)
    strategy.load_ckpt(engine, os.path.join(out, "ams"))
    got = dict(optimizer=optimizer_snapshot(engine), saved_optimizer=ams["optimizer"])
    reshape_train(strategy, engine, optimizer, scheduler, 1, 2 * RESHAPE_TRAIN)
    got["stepped"] = engine.global_steps == 3
    strategy = reshape_strategy(1, adam_offload=True)
    engine, _, _ = reshape_engine(strategy, 999)
    got["offload_before"] = full_state(engine)
    got["offload"] = error_of(strategy.load_ckpt, engine, os.path.join(out, "ams"))
    return dict(got, offload_after=full_state(engine))


def review_groups(z2):
    strategy = reshape_strategy(3)
    engine, optimizer, _ = reshape_engine(strategy, 999, groups="reversed")
    got = dict(reversed=error_of(strategy.load_ckpt, engine, z2))
    engine, _, _ = reshape_engine(strategy, 999, groups="all")
    return dict(got, one_group=error_of(strategy.load_ckpt, engine, z2))


def review_cases(rank, out):
    """The review's cases, by result key, for the core launch."""
    z2 = os.path.join(out, "z2")
    cases = {"classes": review_classes, "saved": partial(review_save, z2)}
    cases.update({f"target_{name}": partial(review_target, z2, name) for name in REVIEW_TARGETS})
    for stage in (2, 1):  # the same shape, and another
        cases[f"frozen_{stage}"] = partial(review_frozen, z2, stage)
    cases["frozen_listed"] = partial(review_frozen_listed, out)
    for stage in (2, 3):  # the same shape with another model, and another shape
        cases[f"not_strict_{stage}"] = partial(review_not_strict, z2, stage)
    for stage, module_only in itertools.product((2, 3), (True, False)):
        cases[f"eval_{0 if stage == 2 else 3}_{module_only}"] = partial(review_eval, z2, stage, module_only)
    cases.update(plain=partial(review_plain, out), amsgrad=partial(review_amsgrad, out))
    cases.update(groups=partial(review_groups, z2), integrity=partial(review_integrity, rank, f"{out}/integrity"))
    return cases


# =============================================================================================================
# A save that fails: on one rank or both, every rank raises within seconds naming the rank, the file and the
# error, the staging folder goes, the previous checkpoint stays loadable, and the run saves again once there is
# room. Real failures, no mock: RLIMIT_FSIZE makes one process's writes fail (EFBIG), and a small tmpfs fills.


@pytest.fixture(scope="module")
def save_failures_run(quick_run):
    return case(quick_run, "save_failures")  # each rank's results


def on_the_small_disk(save_failures_run):
    """Each rank's results of the saves onto the quick launch's small disk; skips where it could not be mounted."""
    if "refused" not in save_failures_run[0]:
        pytest.skip("a full disk needs a tmpfs, which needs root")
    return save_failures_run


@pytest.mark.parametrize("failing", ["rank0", "rank1", "both"])
def test_a_write_that_fails_on_any_rank_raises_on_every_rank_at_once_and_leaves_the_last_checkpoint(
    save_failures_run, failing
):
    named = 1 if failing == "rank1" else 0  # every rank says the same: the lowest failing rank's failure
    for result in save_failures_run:
        got = result[failing]
        assert got["error"].startswith(f"RuntimeError: save_ckpt failed on rank {named} "), got["error"]
        assert "_states.pt" in got["error"] and "ulimit -f" in got["error"], got["error"]  # the file, the cause
        assert got["seconds"] < 30, got["seconds"]
        assert checkpoints(got["left"]) == ["global_step1", "latest"], got["left"]  # no staging folder
        assert got["latest"] == "global_step1"


def test_save_model_that_fails_on_rank_0_raises_on_every_rank_at_once_naming_it(save_failures_run):
    for rank, result in enumerate(save_failures_run):
        got = result["save_model_fails"]
        assert got["seconds"] < 30 and got["left"] == [], got  # nothing half-written left in its place
        assert got["error"].startswith("RuntimeError: ") and "unexpected pos" in got["error"], got["error"]  # torch's
        assert rank == 0 or got["error"].startswith("RuntimeError: RuntimeError on rank 0: "), got["error"]


def test_save_model_out_of_memory_on_rank_0_while_copying_raises_on_every_rank_at_once(save_failures_run):
    for rank, result in enumerate(save_failures_run):
        got = result["save_model_oom"]
        assert "DefaultCPUAllocator: can't allocate memory" in got["error"] and got["seconds"] < 30, got
        assert rank == 0 or got["error"].startswith("RuntimeError: RuntimeError on rank 0: "), got


def test_a_rank_that_cannot_see_save_dir_fails_the_save_on_every_rank_at_once(save_failures_run):
    for result in save_failures_run:
        got = result["lost_mount"]
        assert got["error"].startswith("RuntimeError: save_ckpt failed on rank 1 "), got["error"]
        assert "cannot be read here" in got["error"] and got["seconds"] < 30, got


def test_load_model_that_fails_on_one_rank_below_zero_3_raises_on_every_rank_at_once(save_failures_run):
    for result in save_failures_run:
        got = result["load_model_fails"]
        assert got["error"].startswith("ValueError: refusing to load: "), got["error"]
        assert "not_on_this_node.pt is missing" in got["error"] and got["seconds"] < 30, got


def test_after_failed_saves_the_last_checkpoint_loads_and_training_saves_again(save_failures_run):
    for result in save_failures_run:
        assert result["resumed_steps"] == 1 and result["resumed_equal"]
        assert checkpoints(result["saved_again"]) == ["global_step1", "global_step5", "latest"]


def test_a_save_the_free_space_cannot_hold_fails_naming_the_free_space_and_gives_it_back(save_failures_run):
    for result in on_the_small_disk(save_failures_run):
        refused = result["refused"]
        assert refused["error"].startswith("RuntimeError: save_ckpt failed on rank "), refused["error"]
        assert "ckpt has 0.0 MiB free; the checkpoint before it is unchanged" in refused["error"], refused["error"]
        assert checkpoints(refused["left"]) == ["global_step1", "latest"]
        assert refused["free_after"] == refused["free_before"]  # the staging folder's space came back
        assert checkpoints(result["after_freeing"]) == ["global_step1", "global_step2", "latest"]


def test_a_disk_that_fills_while_rank_0_writes_gives_its_space_back_and_names_the_file(save_failures_run):
    for result in on_the_small_disk(save_failures_run):
        full = result["disk_full"]
        assert full["error"].startswith("RuntimeError: save_ckpt failed on rank 0 "), full["error"]
        assert "global_step3.saving/" in full["error"] and "_states.pt" in full["error"], full["error"]
        assert "ckpt has 0.0 MiB free" in full["error"], full["error"]
        assert checkpoints(full["left"]) == ["global_step1", "global_step2", "latest"], full["left"]
        assert full["free_after"] == full["free_before"]  # the staging folder's space came back


def checkpoints(names):
    """A save_dir's listing without the scripts DeepSpeed copies there (zero_to_fp32.py, ...)."""
    return [name for name in names if not name.endswith(".py")]


def save_failures(rank, out):
    results = {}
    strategy = new_strategy(2)
    engine, optimizer, scheduler = prepared(strategy)
    batches = iter(strategy.setup_dataloader(make_dataset(), MICRO))
    ckpt = os.path.join(out, "ckpt")
    train(strategy, engine, optimizer, scheduler, batches, 1)
    strategy.save_ckpt(engine, ckpt)
    saved = full_params(engine)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    for failing in ("rank0", "rank1", "both"):
        train(strategy, engine, optimizer, scheduler, batches, 1)
        if failing in ("both", f"rank{rank}"):
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
        start = time.time()
        error = error_of(strategy.save_ckpt, engine, ckpt)
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        latest = Path(ckpt, "latest").read_text()
        results[failing] = dict(error=error, seconds=time.time() - start, left=sorted(os.listdir(ckpt)), latest=latest)
    # save_model where rank 0 alone cannot write: every rank raises at once, naming rank 0's error.
    if rank == 0:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    start = time.time()
    error = error_of(strategy.save_model, engine, None, os.path.join(out, "weights"))
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    left = os.listdir(os.path.join(out, "weights"))
    results["save_model_fails"] = dict(error=error, seconds=time.time() - start, left=left)
    # save_model where rank 0 runs out of host memory while it copies the weights: every rank raises at once.
    to = torch.Tensor.to

    def out_of_memory(self, *args, **kwargs):
        if kwargs.get("copy"):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory (this test's)")
        return to(self, *args, **kwargs)

    torch.Tensor.to = out_of_memory if rank == 0 else to
    start = time.time()
    try:
        error = error_of(strategy.save_model, engine, None, os.path.join(out, "weights_oom"))
    finally:
        torch.Tensor.to = to
    results["save_model_oom"] = dict(error=error, seconds=time.time() - start)
    # A save where rank 1's node cannot see save_dir at all (its mount lost; here a path through a file): every
    # rank raises at once, naming rank 1, which must not fail again while it words its own failure.
    Path(out, "a_file").write_text("")
    lost = ckpt if rank == 0 else os.path.join(out, "a_file", "ckpt")
    start = time.time()
    results["lost_mount"] = dict(error=error_of(strategy.save_ckpt, engine, lost), seconds=time.time() - start)
    # load_model where rank 1's node lacks the file (each rank passes a path on its own node): every rank raises.
    path = os.path.join(out, "weights.pt" if rank == 0 else "not_on_this_node.pt")
    on_rank_0(torch.save, engine.module.state_dict(), path)
    start = time.time()
    results["load_model_fails"] = dict(error=error_of(strategy.load_model, engine, path), seconds=time.time() - start)
    resumed = new_strategy(2)
    engine2, _, _ = prepared(resumed, init_seed=999)
    resumed.load_ckpt(engine2, ckpt)
    params = full_params(engine2)
    results["resumed_steps"] = engine2.global_steps
    results["resumed_equal"] = all(torch.equal(params[name], saved[name]) for name in saved)
    train(strategy, engine, optimizer, scheduler, batches, 1)
    strategy.save_ckpt(engine, ckpt)
    results["saved_again"] = sorted(os.listdir(ckpt))
    if not os.path.ismount(os.path.join(out, "small_disk")):
        return results
    disk = os.path.join(out, "small_disk", "ckpt")  # a 16 MiB tmpfs
    strategy.save_ckpt(engine2, disk, tag="global_step1")
    size = folder_bytes(os.path.join(disk, "global_step1"))
    filler = Path(out, "small_disk", "filler")

    def leave_room(room):  # fill the disk but for room bytes
        filler.write_bytes(bytes(shutil.disk_usage(disk).free - room))

    on_rank_0(leave_room, size // 2)  # half a checkpoint's room
    before = shutil.disk_usage(disk).free
    got = dict(error=error_of(strategy.save_ckpt, engine2, disk, tag="global_step2"), free_before=before)
    results["refused"] = dict(got, left=sorted(os.listdir(disk)), free_after=shutil.disk_usage(disk).free)
    on_rank_0(filler.unlink)
    strategy.save_ckpt(engine2, disk, tag="global_step2")
    results["after_freeing"] = sorted(os.listdir(disk))
    on_rank_0(leave_room, size * 3 // 2)  # passes the check; with a client_state of one more it needs 2
    before = shutil.disk_usage(disk).free
    big = {"blob": torch.ones(size // 4)}
    got = dict(error=error_of(strategy.save_ckpt, engine2, disk, tag="global_step3", client_state=big))
    results["disk_full"] = dict(
        got, left=sorted(os.listdir(disk)), free_before=before, free_after=shutil.disk_usage(disk).free
    )
    return results


# =============================================================================================================
# Crash points, explored (the method of ALICE, Pillai et al., OSDI 2014): one process saves three checkpoints
# under strace, which records every file-system operation that save_ckpt and DeepSpeed perform in save_dir. The
# test rebuilds save_dir as a crash after each operation would leave it, in two models, and loads every state.
# A killed process keeps all it did. A power cut keeps only what was made durable: a file's bytes up to its last
# fsync, and a folder's names (new files, renames, deletions) as of the folder's last fsync. The saves: a first
# one, a second whose rotation (max_num=1) deletes the first, a third under the second's tag, which replaces it,
# and a fourth under that tag again after the third was left as a crash after its record leaves it (<tag>.saving,
# from which a run resumes); the third's states are loaded a second time with `latest` lost.

TRACED = "openat,creat,write,pwrite64,writev,sendfile,copy_file_range,ftruncate,fsync,fdatasync"
TRACED += ",rename,renameat,renameat2,mkdir,mkdirat,unlink,unlinkat,rmdir"


def traced_operations(trace):
    """(operation, path, argument) of each call in an `strace -f -y` log that succeeded, in order; strace -y
    writes each file descriptor with its path, as 5</path>. The record worker marks the end of each save by
    opening a file named marker<N>."""
    unfinished, fd = {}, r"(?:AT_FDCWD|-?\d+)(?:<([^>]*)>)?"
    for line in open(trace):
        pid, _, line = line.strip().partition(" ")
        line = line.lstrip()  # strace pads the pid column to a width
        if line.endswith("<unfinished ...>"):  # a call another thread interrupted in the log
            unfinished[pid] = line.removesuffix("<unfinished ...>")
            continue
        resumed = re.match(r"<\.\.\. \w+ resumed>(.*)", line)
        line = unfinished.pop(pid, "") + resumed.group(1) if resumed else line
        call = re.match(r"(\w+)\((.*)\)\s+= (-?\d+)(?:<([^>]*)>)?", line)
        if not call or int(call.group(3)) < 0:
            continue
        name, args, result, opened = call.groups()
        strings, fds = re.findall(r'"((?:[^"\\]|\\.)*)"', args), re.findall(fd, args)

        def at(i):  # the i-th path argument, joined to its folder's descriptor for the *at calls
            relative = name.endswith("at") or name.startswith("renameat")
            return os.path.join(fds[i], strings[i]) if relative else strings[i]

        if name in ("openat", "creat") and re.search(r"/marker\d+$", opened or strings[0]):
            yield "marker", None, None
        elif name in ("openat", "creat") and (name == "creat" or "O_CREAT" in args):
            yield "create", opened, name == "creat" or "O_TRUNC" in args
        elif name in ("write", "writev", "sendfile", "copy_file_range"):
            yield "write", fds[2] if name == "copy_file_range" else fds[0], int(result)
        elif name == "pwrite64":
            yield "write_at", fds[0], int(args.rsplit(",", 1)[1]) + int(result)
        elif name == "ftruncate":
            yield "truncate", fds[0], int(args.rsplit(",", 1)[1])
        elif name in ("fsync", "fdatasync"):
            yield "fsync", fds[0], None
        elif name.startswith("rename"):
            yield "rename", at(0), at(1)
        elif name in ("mkdir", "mkdirat"):
            yield "mkdir", at(0), None
        elif name in ("unlink", "unlinkat", "rmdir"):
            yield "remove", at(0), None


class Node:
    """A file or a folder of the model: a file's length now and durably, a folder's names now and durably."""

    def __init__(self, folder):
        self.folder, self.length, self.durable_length, self.source = folder, 0, 0, None
        self.names, self.durable_names = {}, {}


def crash_states(operations, root, snapshots):
    """Yields (save, kill state, power-cut state) after each operation under root (a consecutive run of writes
    to one file counts as one, cut once in the middle too). A state maps each path relative to root to None (a
    folder) or (the file's node, how many bytes), whose source names the file its bytes come from once the save
    that made it has ended. snapshots[k]: root as save k left it."""
    top, save = Node(folder=True), 0

    def node_at(path):
        node = top
        for part in os.path.relpath(path, root).split(os.sep):
            node = node if part == "." else node.names[part]
        return node

    def place(path):
        return node_at(os.path.dirname(path)), os.path.basename(path)

    def state(durable):
        files, stack = {}, [("", top)]
        while stack:
            prefix, folder = stack.pop()
            for name, node in (folder.durable_names if durable else folder.names).items():
                path = os.path.join(prefix, name)
                files[path] = None if node.folder else (node, node.durable_length if durable else node.length)
                if node.folder:
                    stack.append((path, node))
        return files

    merged = []
    for operation, path, argument in operations:
        if merged and operation == "write" and merged[-1][:2] == ["write", path]:
            merged[-1][2] += argument
        else:
            merged.append([operation, path, argument])
    for operation, path, argument in merged:
        if operation == "marker":  # a save ended: the files it made are as it left them in its snapshot
            for name, spec in state(durable=False).items():
                if spec is not None and node_at(os.path.join(root, name)).source is None:
                    node_at(os.path.join(root, name)).source = os.path.join(snapshots[save], name)
            save += 1
            continue
        if not (path or "").startswith(root + os.sep) and (path, operation) != (root, "fsync"):
            continue  # outside root, or root's own making
        if operation in ("create", "mkdir"):
            folder, name = place(path)
            if name not in folder.names:
                folder.names[name] = Node(folder=operation == "mkdir")
            elif argument:  # O_TRUNC
                folder.names[name].length = 0
        elif operation == "write":  # appended: half, a crash point, then the rest
            node_at(path).length += argument // 2
            yield save, state(False), state(True)
            node_at(path).length += argument - argument // 2
        elif operation == "write_at":
            node_at(path).length = max(node_at(path).length, argument)
        elif operation == "truncate":
            node = node_at(path)
            node.length, node.durable_length = argument, min(node.durable_length, argument)
        elif operation == "fsync":
            node = node_at(path)
            node.durable_names, node.durable_length = dict(node.names), node.length
        elif operation == "rename":
            (old, old_name), (new, new_name) = place(path), place(argument)
            new.names[new_name] = old.names.pop(old_name)
        elif operation == "remove":
            folder, name = place(path)
            del folder.names[name]
        yield save, state(False), state(True)


def lay_out(files, where):
    """Write a crash state into the new folder where: each file holds the first bytes of its source."""
    os.makedirs(where)
    for path, spec in sorted(files.items()):
        target = os.path.join(where, path)
        if spec is None:
            os.makedirs(target, exist_ok=True)
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        node, length = spec
        with open(target, "wb") as f:
            if node.source is not None and os.path.exists(node.source):
                with open(node.source, "rb") as s:
                    f.write(s.read(length))
            f.write(bytes(length - f.tell()))  # made and deleted within one save: no source, zeros


def run_crash_record(out, mode):
    """The traced process: four saves into out/ckpt, each followed by a marker and a snapshot of the folder; with
    mode "background", each save's writes, agreement and commit on its thread (waited for before the marker)."""
    strategy = new_strategy(2)
    engine, optimizer, scheduler = prepared(strategy)
    batches = iter(strategy.setup_dataloader(make_dataset(), MICRO, shuffle=False))
    ckpt = os.path.join(out, "ckpt")
    os.makedirs(ckpt)
    for save, tag in enumerate(["global_step1", "global_step2", "global_step2", "global_step2"]):
        train(strategy, engine, optimizer, scheduler, batches, 1)
        if save == 3:  # as a crash after the third save's record, before its rename, leaves it: resumed from there
            os.rename(os.path.join(ckpt, tag), os.path.join(ckpt, tag + ".saving"))
        strategy.save_ckpt(engine, ckpt, tag=tag, max_num=1, background=mode == "background")
        get_strategy_module.wait_for_save(strategy)
        open(os.path.join(out, f"marker{save}"), "w").close()
        shutil.copytree(ckpt, os.path.join(out, f"snapshot{save}"))
    strategy.teardown()


@pytest.fixture(scope="module", params=["written by save_ckpt", "background"])
def crash_points(tmp_path_factory, request):
    """{model: [(save, the step it was saving, what load_ckpt gave: a step, None or an error), ...]}."""
    if shutil.which("strace") is None:
        pytest.skip("the crash-point harness records with strace: apt-get install strace")
    out = tmp_path_factory.mktemp("crash_points")
    trace = out / "trace"
    cmd = ["strace", "-f", "-y", "-s", "0", "-e", f"trace={TRACED}", "-o", str(trace)]
    cmd += [PYTHON, "test_get_strategy.py", "--worker", "crash_record", str(out), request.param]
    returncode, output = launch(cmd, 300)
    assert returncode == 0, output[-5000:]
    root, snapshots = str(out / "ckpt"), [str(out / f"snapshot{k}") for k in range(4)]
    with in_this_process():
        return load_crash_states(out, list(crash_states(traced_operations(trace), root, snapshots)))


def load_crash_states(out, states):
    strategy = new_strategy(2)
    engine, _, _ = prepared(strategy, init_seed=999)
    got = {"kill": [], "power": [], "latest lost": []}
    for number, (save, kill, power) in enumerate(states):
        for model, files in (("kill", kill), ("power", power), ("latest lost", kill)):
            if model == "latest lost":
                if save != 2:
                    continue
                files = {path: spec for path, spec in files.items() if path != "latest"}
            where = str(out / "states" / f"{model}{number}")
            lay_out(files, where)
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    load_path, _ = strategy.load_ckpt(engine, where)
                got[model].append((save, load_path and engine.global_steps))
            except Exception as error:
                got[model].append((save, f"{type(error).__name__}: {error}"))
            shutil.rmtree(where)
    print({model: len(states) for model, states in got.items()}, "crash states loaded")
    return got


@pytest.mark.full
def test_a_crash_at_any_file_operation_of_a_save_leaves_the_newest_committed_checkpoint_or_the_one_before(
    crash_points,
):
    """Save k saves step k + 1 (the third and fourth under the tag of step 2): a crash while it runs must load
    step k + 1 or the newest step saved before it (none before the first), never a partial checkpoint, never
    an error."""
    for model, states in crash_points.items():
        # Every operation of the three saves (of the third alone with latest lost), not a handful of them.
        assert len(states) > (30 if model == "latest lost" else 100), (model, len(states))
        for save, loaded in states:
            before = {0: None, 1: 1, 2: 2, 3: 3}[save]
            assert loaded in (before, save + 1), (model, save, loaded)


# =============================================================================================================
# The workers, run in the launched processes.


def full_params(engine):
    """Every parameter of an engine at full size (gathered under ZeRO 3), as copies in its dtype."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_partition_weights()):
        return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def new_strategy(stage, bf16=False, train_batch_size=TRAIN, max_norm=MAX_NORM, **flags):
    args = argparse.Namespace(zero_stage=stage, micro_train_batch_size=MICRO, train_batch_size=train_batch_size)
    vars(args).update(max_norm=max_norm, bf16=bf16, seed=42, **flags)
    strategy = get_strategy(args)
    strategy.setup_distributed(timeout=timedelta(minutes=2))
    return strategy


def prepared(strategy, dropout=0.0, init_seed=1234, schedule=lr_lambda, lr=LR, betas=BETAS):
    model = make_model(dropout, init_seed)
    optimizer = strategy.create_optimizer(model, lr=lr, betas=betas, eps=EPS, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return strategy.prepare((model, optimizer, scheduler))


def train(strategy, engine, optimizer, scheduler, loader, steps):
    """steps optimizer steps from loader; returns each micro-batch's loss, averaged over ranks."""
    losses = []
    batches = iter(loader)
    for _ in range(steps * strategy.accumulated_gradient):
        x, y = next(batches)
        dtype = next(engine.module.parameters()).dtype
        loss = F.mse_loss(engine(x.to(dtype)).float(), y)
        strategy.backward(loss, engine, optimizer)
        strategy.optimizer_step(optimizer, engine, scheduler)
        losses.append(strategy.all_reduce(loss.item()))
    return losses


def train_like_the_reference(stage, **flags):
    """STEPS optimizer steps through the strategy over the reference's batches (the loader unshuffled)."""
    strategy = new_strategy(stage, **flags)
    engine, optimizer, scheduler = prepared(strategy)
    loader = strategy.setup_dataloader(make_dataset(), MICRO, shuffle=False)
    train(strategy, engine, optimizer, scheduler, loader, STEPS)
    return engine, optimizer, scheduler


def trained_like_the_reference(stage):
    engine, optimizer, scheduler = train_like_the_reference(stage)
    partitioned = any(p.numel() == 0 for p in engine.module.parameters())
    got = dict(params=full_params(engine), global_steps=engine.global_steps, optimizer=type(optimizer).__name__)
    full_numel = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())  # ZeRO 3: ds_numel
    return dict(got, lr=scheduler.get_last_lr()[0], partitioned=partitioned, full_numel=full_numel)


def trained_with_the_lr_set_by_hand(stage):
    """The reference's steps without a scheduler: prepare((model, optimizer, None)), and the loop setting each step's
    learning rate on the optimizer prepare returns, as nanoGPT's does."""
    strategy = new_strategy(stage)
    model = make_model()
    optimizer = strategy.create_optimizer(model, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    engine, optimizer, _ = strategy.prepare((model, optimizer, None))
    batches = iter(strategy.setup_dataloader(make_dataset(), MICRO, shuffle=False))
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = LR * lr_lambda(step)
        train(strategy, engine, optimizer, None, batches, 1)
    return full_params(engine)


def prepared_from_rank_dependent_weights(rank):
    """At each stage, a model whose weights differ on each rank: what every rank holds after prepare."""
    got = {}
    for stage in range(4):
        strategy = new_strategy(stage)
        model = make_model(init_seed=1000 + rank)
        engine, _, _ = strategy.prepare((model, strategy.create_optimizer(model, lr=LR), None))
        got[stage] = full_params(engine)
    return got


def bf16_training(stage):
    strategy = new_strategy(stage, bf16=True)
    engine, optimizer, scheduler = prepared(strategy, schedule=lambda step: 1.0, lr=0.01)
    loader = strategy.setup_dataloader(make_dataset(), MICRO)
    epoch_losses = []
    for epoch in range(4):
        loader.sampler.set_epoch(epoch)
        losses = train(strategy, engine, optimizer, scheduler, loader, len(loader) // ACCUM)
        epoch_losses.append(sum(losses) / len(losses))
    return dict(epoch_losses=epoch_losses, param_dtype=str(next(engine.parameters()).dtype))


def offload_training(stage):
    engine, _, _ = train_like_the_reference(stage, adam_offload=True)
    return dict(params=full_params(engine), basic_optimizer=type(engine.basic_optimizer).__name__)


def offload_resumed_late(out_dir):
    """20 steps at ZeRO 2, bf16, adam_offload, saved at step 10, and the last 10 again from the checkpoint: the
    weights, fp32 masters and Adam's moments of each. Betas (0.9, 0.95), as gpu_check.py's: in float32, 0.95 ** 11
    taken by pow() is not the product of eleven 0.95s (0.9 ** 11 and 0.99 ** 11 happen to be)."""
    strategy = new_strategy(2, bf16=True, adam_offload=True)
    engine, optimizer, scheduler = prepared(strategy, betas=(0.9, 0.95))
    loader = strategy.setup_dataloader(make_dataset(), MICRO)
    stream = []  # each rank's micro-batches of 3 epochs (8 steps an epoch)
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        stream += list(loader)

    def state(engine):
        masters = {f"{n} {key}": t for n, state in optimizer_snapshot(engine).items() for key, t in state.items()}
        return {**full_state(engine), **masters}

    start, batches, folder = full_state(engine), iter(stream), os.path.join(out_dir, "offload_late")
    train(strategy, engine, optimizer, scheduler, batches, 10)
    strategy.save_ckpt(engine, folder)
    train(strategy, engine, optimizer, scheduler, batches, 10)
    uninterrupted = state(engine)
    engine, optimizer, scheduler = prepared(strategy, init_seed=999, betas=(0.9, 0.95))
    strategy.load_ckpt(engine, folder)
    train(strategy, engine, optimizer, scheduler, iter(stream[10 * ACCUM :]), 10)
    resumed = state(engine)
    moved = max((uninterrupted[n] - start[n]).abs().max().item() for n in start)
    return dict(moved=moved, diff=max((resumed[n] - uninterrupted[n]).abs().max().item() for n in resumed))


def collectives(rank):
    strategy = new_strategy(0)
    mine = torch.tensor([1.0, 2.0]) + 2 * rank
    got = dict(
        mean=strategy.all_reduce(mine),
        max=strategy.all_reduce(mine, "max"),
        sum=strategy.all_reduce(mine, "sum"),
        input_after=mine.clone(),
        int_sum=strategy.all_reduce(2**40 * (1 - rank) + rank, "sum"),
        float_mean=strategy.all_reduce(0.5 * (rank + 1)),
        dict=strategy.all_reduce({"loss": 0.5 * (rank + 1), "tokens": 2**40 * (1 - rank) + rank}, "sum"),
        gather_tensor=strategy.all_gather(mine.reshape(1, 2)),
        gather_number=strategy.all_gather(0.5 * (rank + 1)),
        gather_scalar=strategy.all_gather(torch.tensor(rank)),
        bool_mean=strategy.all_reduce(torch.tensor([rank == 0, True])),
        bool_sum=strategy.all_reduce(torch.tensor([True, True]), "sum"),
        bool_max=strategy.all_reduce(torch.tensor([rank == 1]), "max"),
        int_mean=strategy.all_reduce(torch.tensor(2**25 + 1)),
        python_bool_sum=strategy.all_reduce(rank == 0, "sum"),
        dict_by_key=strategy.all_reduce({"a": 1, "b": 100} if rank == 0 else {"b": 100, "a": 1}, "sum"),
        ragged=strategy.all_gather(torch.arange(rank + 1) + 10 * rank),
        ragged_rows=strategy.all_gather(torch.full((rank + 1, 3), float(rank))),
        gather_dict_by_key=strategy.all_gather({"x": rank, "y": -rank} if rank == 0 else {"y": -rank, "x": rank}),
    )
    got["keys_differ"] = error_of(strategy.all_reduce, {"a": 1} if rank == 0 else {"b": 1})
    got["gather_keys_differ"] = error_of(strategy.all_gather, {"a": 1} if rank == 0 else {"b": 1})
    got["gather_columns_differ"] = error_of(strategy.all_gather, torch.zeros(2, rank + 1))
    return got


def dataloader_shards():
    strategy = new_strategy(0)
    dataset = torch.utils.data.TensorDataset(torch.arange(20))
    indices = lambda loader: [int(i) for (batch,) in loader for i in batch]  # noqa: E731
    loader = strategy.setup_dataloader(dataset, 2)
    epoch0 = indices(loader)
    never_set = strategy.setup_dataloader(dataset, 2)  # a trainer that never calls set_epoch
    never_set_epochs = [indices(never_set) for _ in range(3)]
    loader.sampler.set_epoch(1)
    return dict(
        epoch0=epoch0,
        epoch0_again=indices(strategy.setup_dataloader(dataset, 2)),
        epoch1=indices(loader),
        resumed=indices(strategy.setup_dataloader(dataset, 2, consumed_samples=8)),
        resumed_len=len(strategy.setup_dataloader(dataset, 2, consumed_samples=8)),
        never_set_epochs=never_set_epochs,
    )


def resumed_exactly(stage, dtype, out_dir):
    strategy = new_strategy(stage, bf16=dtype == "bf16")
    ckpt_dir = os.path.join(out_dir, f"resume_{stage}_{dtype}")
    dataset = make_dataset()
    # Uninterrupted: 3 steps, a checkpoint, 3 more.
    engine, optimizer, scheduler = prepared(strategy, dropout=0.1)
    batches = iter(strategy.setup_dataloader(dataset, MICRO))
    losses = train(strategy, engine, optimizer, scheduler, [next(batches) for _ in range(3 * ACCUM)], 3)
    strategy.save_ckpt(engine, ckpt_dir, client_state={"consumed_samples": 3 * TRAIN, "note": "hello"})
    losses += train(strategy, engine, optimizer, scheduler, batches, 3)
    uninterrupted = full_params(engine)
    # Disturb every generator, then resume into fresh engines whose weights start elsewhere.
    random.random(), numpy.random.rand(), torch.rand(7)
    engine, optimizer, scheduler = prepared(strategy, dropout=0.1, init_seed=999)
    fresh = full_params(engine)
    _, client_state = strategy.load_ckpt(engine, ckpt_dir)
    loader = strategy.setup_dataloader(dataset, MICRO, consumed_samples=client_state["consumed_samples"])
    resumed_losses = train(strategy, engine, optimizer, scheduler, loader, 3)
    return dict(
        uninterrupted_losses=losses,
        resumed_losses=resumed_losses,
        uninterrupted_params=uninterrupted,
        resumed_params=full_params(engine),
        client_state={k: client_state[k] for k in ("consumed_samples", "note")},
        fresh_params_differed=not torch.equal(fresh["0.weight"], uninterrupted["0.weight"]),
    )


def rotation(rank, out_dir):
    strategy = new_strategy(2)
    engine, optimizer, scheduler = prepared(strategy)
    loader = strategy.setup_dataloader(make_dataset(), MICRO)
    save_dir = os.path.join(out_dir, "rotation")
    if rank == 0:
        os.makedirs(os.path.join(save_dir, "notes"))
        Path(save_dir, "notes", "keep.txt").write_text("not a checkpoint")
    after_each_save = []
    listing = lambda d: sorted(checkpoints(os.listdir(d)))  # noqa: E731 (DeepSpeed adds its scripts to a save_dir)
    for _ in range(3):
        train(strategy, engine, optimizer, scheduler, loader, 1)
        strategy.save_ckpt(engine, save_dir, max_num=2)
        after_each_save.append(listing(save_dir))
    # By size: three saves of the same step under distinct tags, with room for two and a half.
    size_dir = os.path.join(out_dir, "rotation_size")
    strategy.save_ckpt(engine, size_dir, tag="global_step1", max_num=10)
    one = folder_bytes(os.path.join(size_dir, "global_step1"))
    for tag in ("global_step1-2", "global_step1-3"):
        time.sleep(0.01)  # distinct modification times
        strategy.save_ckpt(engine, size_dir, tag=tag, max_num=10, max_mem=2.5 * one / 1024**3)
    notes_intact = Path(save_dir, "notes", "keep.txt").read_text() == "not a checkpoint"
    latest = Path(save_dir, "latest").read_text()
    return dict(
        after_each_save=after_each_save,
        notes_intact=notes_intact,
        latest=latest,
        by_size=[n for n in listing(size_dir) if n != "latest"],
    )


def checkpoint_rules(rank, out_dir):
    """The rules of which checkpoints rotation keeps, links, crashed saves' leftovers and a checkpoint folder given
    as load_dir; each step's listing as rank 0 sees it after the save."""
    strategy = new_strategy(2)
    engine, _, _ = prepared(strategy)
    got = {}

    def listing(save_dir):
        dist.barrier()
        return sorted(n for n in checkpoints(os.listdir(save_dir)) if n != "latest")

    def saves(save_dir, steps, **options):  # (tag, metric_value, save_latest) each; the listing after each
        after = []
        for tag, metric, latest in steps:
            time.sleep(0.01)  # distinct modification times
            strategy.save_ckpt(engine, save_dir, tag=tag, metric_value=metric, save_latest=latest, **options)
            after.append(listing(save_dir))
        return after

    metric_dir = os.path.join(out_dir, "metric")
    steps = [("s1", 0.5, True), ("s2", None, True), ("s3", 0.9, True), ("best_s4", 1.0, True), ("s5", 0.1, True)]
    steps += [("best_s6", 1.2, True), ("s7", 0.3, True), ("s8", 0.9, True), ("s9", 0.9, True), ("s10", 5.0, False)]
    got["by_metric"] = saves(metric_dir, steps, max_num=2, metric_key="reward")
    got["record_metric"] = json.loads(Path(metric_dir, "s9", "checkpoint_complete.json").read_text())["metric"]
    # max_mem counts a best checkpoint, which still is never deleted.
    mem_dir = os.path.join(out_dir, "metric_mem")
    strategy.save_ckpt(engine, mem_dir, tag="best_a", metric_value=1.0)
    one = folder_bytes(os.path.join(mem_dir, "best_a"))
    got["by_size"] = saves(mem_dir, [("r1", None, True), ("r2", None, True)], max_num=10, max_mem=2.5 * one / 2**30)
    # A run that moved onto this file from OpenRLHF's strategy: plain DeepSpeed checkpoints, with metric.json.
    moved = os.path.join(out_dir, "moved")
    for tag, metric in (("global_step1", 0.8), ("global_step2", 0.2)):
        engine.save_checkpoint(moved, tag=tag)
        if rank == 0:
            Path(moved, tag, "metric.json").write_text(json.dumps({"metric_key": "reward", "metric_value": metric}))
    got["moved"] = saves(moved, [("global_step3", 0.5, True)], max_num=2)
    # A run branched from an archived checkpoint through a link.
    archive, branch = os.path.join(out_dir, "archive"), os.path.join(out_dir, "branch")
    strategy.save_ckpt(engine, archive, tag="global_step1")
    if rank == 0:
        os.makedirs(branch)
        os.symlink(os.path.join(archive, "global_step1"), os.path.join(branch, "global_step1"))
    steps = [("s2", None, True), ("s3", None, True), ("s4", None, True)]
    got["branch_error"] = error_of(saves, branch, steps, max_num=2)
    got["branch"] = listing(branch)
    got["archive_intact"] = os.path.isfile(os.path.join(archive, "global_step1", "checkpoint_complete.json"))
    # A crashed save's staging folder goes with the next successful save; a later one stays.
    stale = os.path.join(out_dir, "stale")
    strategy.save_ckpt(engine, stale, tag="global_step1")
    if rank == 0:
        os.makedirs(os.path.join(stale, "global_step2.saving"))
        Path(stale, "global_step2.saving", "mp_rank_00_model_states.pt").write_bytes(b"half")
    time.sleep(0.01)
    got["stale"] = saves(stale, [("global_step3", None, True)])
    # A rotation that fails after the commit: a file that cannot be removed (a mount point: a file bound over it)
    # in the checkpoint to delete. The save is kept and says what failed; the next save goes ahead all the same.
    busy = os.path.join(out_dir, "busy")
    strategy.save_ckpt(engine, busy, tag="old")
    mounted, stuck = None, os.path.join(busy, "old", "rng_state_rank0.pt")
    if rank == 0:
        Path(out_dir, "bound").write_bytes(b"x")
        mounted = subprocess.run(["mount", "--bind", os.path.join(out_dir, "bound"), stuck]).returncode == 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        got["busy_error"] = error_of(strategy.save_ckpt, engine, busy, tag="new", max_num=1)
    got["busy_printed"], got["busy"] = out.getvalue(), listing(busy)
    got["busy_next"] = error_of(strategy.save_ckpt, engine, busy, tag="newer", max_num=1)
    if rank == 0:
        got["busy_latest"] = Path(busy, "latest").read_text()
        if mounted:
            subprocess.run(["umount", stuck.replace(os.sep + "old" + os.sep, os.sep + "old.deleting" + os.sep)])
    got["busy_mounted"] = mounted
    # A checkpoint's own folder given as load_dir.
    got["load_dir_is_checkpoint"] = error_of(strategy.load_ckpt, engine, os.path.join(metric_dir, "s9"))
    # The first save, where rank 0 cannot copy DeepSpeed's zero_to_fp32.py into save_dir (a folder of that name).
    scripts = os.path.join(out_dir, "scripts")
    on_rank_0(os.makedirs, os.path.join(scripts, "zero_to_fp32.py"))
    start = time.time()
    got["scripts_error"] = error_of(strategy.save_ckpt, engine, scripts)
    got["scripts_seconds"], got["scripts"] = time.time() - start, listing(scripts)
    # A metric that is NaN on rank 1 alone (its own evaluation diverged): every rank refuses, none waits.
    start = time.time()
    nan_dir = os.path.join(out_dir, "nan_on_one_rank")
    got["nan_error"] = error_of(strategy.save_ckpt, engine, nan_dir, metric_value=float("nan") if rank else 0.5)
    got["nan_metric"] = json.loads(Path(nan_dir, "global_step0", DONE_FILE).read_text())["metric"]
    return got


def groups_by_name(stage, out_dir):
    """At ZeRO stage: a run with a group per layer and each group's learning rate (a LambdaLR of its own per
    group) saves after 2 steps and trains 2 more; a fresh run that lists the same groups in the other order is
    refused; one that lists them alike resumes the checkpoint and trains 2 steps. Each group's lr after the load,
    and the final weights of both."""
    layers = {"first": ["0.weight", "0.bias"], "rest": ["1.weight", "1.bias", "4.weight", "4.bias"]}
    lrs = {"first": 0.001, "rest": 0.004}

    def run(stage, order, init_seed):
        strategy = new_strategy(stage)
        model = make_model(init_seed=init_seed)
        params = dict(model.named_parameters())
        groups = [{"params": [params[n] for n in layers[g]], "lr": lrs[g], "weight_decay": 0.0} for g in order]
        optimizer = torch.optim.AdamW(groups, betas=BETAS, eps=EPS)
        # A schedule per group, so that a scheduler restored by position gives a group another group's decay.
        schedules = {"first": lambda step: 1.0 / (1.0 + step), "rest": lambda step: 0.5**step}
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [schedules[g] for g in order])
        engine, optimizer, scheduler = strategy.prepare((model, optimizer, scheduler))
        return strategy, engine, optimizer, scheduler

    def lr_by_layer(optimizer, order):
        base = getattr(optimizer, "optimizer", optimizer)
        return {g: group["lr"] for g, group in zip(order, base.param_groups)}

    ckpt = os.path.join(out_dir, f"groups_stage{stage}")
    strategy, engine, optimizer, scheduler = run(stage, ["first", "rest"], 1234)
    batches = iter(strategy.setup_dataloader(make_dataset(), MICRO, shuffle=False))
    train(strategy, engine, optimizer, scheduler, batches, 2)
    strategy.save_ckpt(engine, ckpt)
    saved_lrs = lr_by_layer(optimizer, ["first", "rest"])
    train(strategy, engine, optimizer, scheduler, batches, 2)
    uninterrupted = full_params(engine)
    resumed, engine, optimizer, scheduler = run(stage, ["rest", "first"], 999)
    got = dict(other_order=error_of(resumed.load_ckpt, engine, ckpt), saved_lrs=saved_lrs)
    resumed, engine, optimizer, scheduler = run(stage, ["first", "rest"], 999)
    resumed.load_ckpt(engine, ckpt)
    got["lrs"] = lr_by_layer(optimizer, ["first", "rest"])
    batches = iter(resumed.setup_dataloader(make_dataset(), MICRO, shuffle=False, consumed_samples=2 * TRAIN))
    train(resumed, engine, optimizer, scheduler, batches, 2)
    params = full_params(engine)
    return dict(got, max_difference=max((params[n] - uninterrupted[n]).abs().max().item() for n in uninterrupted))


def load_errors(rank, out_dir):
    strategy = new_strategy(2)
    engine, optimizer, scheduler = prepared(strategy)
    got = {}
    empty = os.path.join(out_dir, "empty")
    half = os.path.join(out_dir, "half")
    if rank == 0:
        os.makedirs(empty, exist_ok=True)
    strategy.save_ckpt(engine, half)
    if rank == 0:
        os.remove(os.path.join(half, "global_step0", "checkpoint_complete.json"))  # as if a rank died while saving
    dist.barrier()
    got["missing"] = strategy.load_ckpt(engine, empty)
    got["incomplete"] = error_of(strategy.load_ckpt, engine, half)
    # A crash between a save's two renames left the new checkpoint complete under <tag>.saving only.
    swapped = os.path.join(out_dir, "swapped")
    strategy.save_ckpt(engine, swapped)
    on_rank_0(os.rename, os.path.join(swapped, "global_step0"), os.path.join(swapped, "global_step0.saving"))
    got["swapped_named"] = error_of(strategy.load_ckpt, engine, swapped, tag="global_step0")
    got["swapped_found"] = strategy.load_ckpt(engine, swapped)[0]
    # A checkpoint is pickled: what a crafted one carries runs while it loads.
    crafted, marker = os.path.join(out_dir, "crafted"), os.path.join(out_dir, "payload_ran")  # rank 0's object
    strategy.save_ckpt(engine, crafted, client_state={"payload": Payload(marker)})
    error_of(strategy.load_ckpt, engine, crafted)  # what the payload left (a file object) may not copy: no matter
    got["payload_ran"] = os.path.exists(marker)
    return got


class Payload:
    """Unpickling it creates a file: the stand-in for code hidden in a file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class SavesPretrained(torch.nn.Sequential):
    """A module with a Hugging Face style save_pretrained, as transformers models have."""

    def save_pretrained(self, directory, state_dict=None, **kwargs):
        torch.save(state_dict, os.path.join(directory, "model.bin"))
        Path(directory, "config.json").write_text(json.dumps({"kwargs": sorted(kwargs)}))


class SavesTokenizer:
    def save_pretrained(self, directory):
        Path(directory, "tokenizer.json").write_text("{}")


def save_model_zero3(rank, out_dir):
    strategy = new_strategy(3)
    engine, optimizer, scheduler = prepared(strategy)
    train(strategy, engine, optimizer, scheduler, strategy.setup_dataloader(make_dataset(), MICRO), 2)
    partitioned = any(p.numel() == 0 for p in engine.module.parameters())
    gathered = full_params(engine)
    out = os.path.join(out_dir, "saved_model")
    strategy.save_model(engine, None, out)
    # Loading into a ZeRO 3 engine: every rank's shard must receive the file's values.
    fresh, _, _ = prepared(strategy, init_seed=7)
    strategy.load_model(fresh, os.path.join(out, "pytorch_model.bin"), strict=True)
    loaded_into_engine = full_params(fresh)
    # A model with save_pretrained gets the gathered state dict; a tokenizer is saved beside it.
    pretrained = strategy.prepare(SavesPretrained(*make_model(init_seed=3)))
    out_pretrained = os.path.join(out_dir, "saved_pretrained")
    pretrained_before = full_params(pretrained)
    for _ in range(5):  # repeated, as a race in gathering shows only some of the time (DeepSpeed before 0.19.8)
        strategy.save_model(pretrained, SavesTokenizer(), out_pretrained, safe_serialization=False)
        pretrained_gathered = full_params(pretrained)
        if any(not torch.equal(pretrained_gathered[n], v) for n, v in pretrained_before.items()):
            break
    # Buffers are never sharded: the saved file holds the persistent ones, as module.state_dict() does.
    with_buffers = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.BatchNorm1d(HIDDEN))
    with_buffers.register_buffer("scratch", torch.ones(3), persistent=False)
    buffers_expected = {k: v.clone() for k, v in with_buffers.state_dict().items()}
    out_buffers = os.path.join(out_dir, "saved_buffers")
    strategy.save_model(strategy.prepare(with_buffers), None, out_buffers)
    got = dict(loaded_into_engine=loaded_into_engine, gathered_here=gathered, after_save_here=full_params(engine))
    got.update(eval_before_save_here=pretrained_before, eval_after_save_here=pretrained_gathered)
    if rank == 0:
        plain = make_model(init_seed=7)
        strategy.load_model(plain, os.path.join(out, "pytorch_model.bin"), strict=True)
        pretrained_kwargs = json.loads(Path(out_pretrained, "config.json").read_text())["kwargs"]
        got.update(
            files=sorted(os.listdir(out)),
            gathered=gathered,
            params_were_partitioned=partitioned,
            saved=torch.load(os.path.join(out, "pytorch_model.bin"), weights_only=True),
            loaded_into_plain={name: p.detach() for name, p in plain.named_parameters()},
            pretrained_files=sorted(os.listdir(out_pretrained)),
            pretrained_kwargs=pretrained_kwargs,
            pretrained_saved=torch.load(os.path.join(out_pretrained, "model.bin"), weights_only=True),
            pretrained_gathered=pretrained_gathered,
            buffers_expected=buffers_expected,
            buffers_saved=torch.load(os.path.join(out_buffers, "pytorch_model.bin"), weights_only=True),
        )
    return got


def prepare_eval():
    got = dict(kinds=[], eval_stage=[], eval_outputs_match_plain_module=[])
    x = make_dataset().tensors[0][:4]
    for stage in (2, 3):
        strategy = new_strategy(stage)
        model = make_model()
        optimizer = strategy.create_optimizer(model, lr=LR)
        reference = make_model(init_seed=3)
        expected = reference(x).detach()
        trained, frozen = strategy.prepare((model, optimizer, None), make_model(init_seed=3))
        with torch.no_grad():
            got["eval_outputs_match_plain_module"].append(torch.allclose(frozen(x), expected, atol=1e-6))
        got["eval_stage"].append(frozen.zero_optimization_stage())
        if stage == 2:
            got["kinds"] = [type(trained).__name__, type(frozen).__name__]
    return got


def load_after_crash(crash_dir):
    strategy = new_strategy(2)
    engine, optimizer, scheduler = prepared(strategy, init_seed=999)
    load_path, _ = strategy.load_ckpt(engine, os.path.join(crash_dir, "ckpt"))
    return dict(load_path=load_path, global_steps=engine.global_steps, params=full_params(engine))


def load_model_then_step(rank, stage, out_dir):
    path = os.path.join(out_dir, "weights_to_load.bin")
    on_rank_0(torch.save, make_model(init_seed=7).state_dict(), path)
    strategy = new_strategy(stage, bf16=stage == 0)
    engine, optimizer, scheduler = prepared(strategy, schedule=lambda step: 0.0)  # lr 0: a step moves nothing
    loader = iter(strategy.setup_dataloader(make_dataset(), MICRO))
    # A step first: from then on ZeRO 3 keeps the small weights whole between uses, and load_model must write
    # those whole copies as well as the shards, or the next forward pass computes with the old ones.
    train(strategy, engine, optimizer, scheduler, loader, 1)
    strategy.load_model(engine, path, strict=True)
    inputs = make_dataset(4).tensors[0]
    output = engine(inputs.to(next(engine.module.parameters()).dtype)).float().detach()
    train(strategy, engine, optimizer, scheduler, loader, 1)
    return dict(params=full_params(engine), steps=engine.global_steps, inputs=inputs, output=output)


def zero_init():
    """A model built under deepspeed.zero.Init, as Hugging Face's from_pretrained builds one at ZeRO 3."""
    strategy = new_strategy(3)
    with deepspeed.zero.Init(config_dict_or_path=strategy.get_ds_train_config()):
        model = make_model()
    sharded_at_build = any(p.numel() == 0 for p in model.parameters())
    optimizer = strategy.create_optimizer(model, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    engine, optimizer, scheduler = strategy.prepare((model, optimizer, scheduler))
    loader = strategy.setup_dataloader(make_dataset(), MICRO, shuffle=False)
    train(strategy, engine, optimizer, scheduler, loader, STEPS)
    return dict(params=full_params(engine), sharded_at_build=sharded_at_build)


def overlap_comm():
    flags = [(stage, flag) for stage in (2, 3) for flag in (False, True)]
    return {(s, flag): prepared(new_strategy(s, overlap_comm=flag))[0].zero_overlap_comm() for s, flag in flags}


class TiedAndShared(torch.nn.Module):
    """A tied embedding and output head, as in GPT-2, and one block registered under two names."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(512, 256)  # 131,072 elements: ZeRO 3 shards it
        self.block = torch.nn.Linear(256, 256)
        self.block_again = self.block
        self.head = torch.nn.Linear(256, 512, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.block_again(self.block(self.emb(idx))))


def tied_and_shared_saved(rank, stage, out_dir):
    strategy = new_strategy(stage)
    model = TiedAndShared()
    expected = {key: value.clone() for key, value in model.state_dict().items()}
    engine, _, _ = strategy.prepare((model, strategy.create_optimizer(model, lr=LR), None))
    out = os.path.join(out_dir, f"tied_stage{stage}")
    strategy.save_model(engine, None, out)
    if rank != 0:
        return {}
    path = os.path.join(out, "pytorch_model.bin")
    saved = torch.load(path, weights_only=True)
    TiedAndShared().load_state_dict(saved, strict=True)
    tie_kept = saved["emb.weight"].data_ptr() == saved["head.weight"].data_ptr()
    return dict(keys=list(saved), expected=expected, saved=saved, tie_kept=tie_kept, file_bytes=os.path.getsize(path))


def module_only_zero3(out_dir):
    strategy = new_strategy(3)
    engine, optimizer, scheduler = prepared(strategy)
    train(strategy, engine, optimizer, scheduler, strategy.setup_dataloader(make_dataset(), MICRO), 2)
    saved = full_params(engine)
    strategy.save_ckpt(engine, os.path.join(out_dir, "module_only"))
    fresh, _, _ = prepared(strategy, init_seed=999)
    strategy.load_ckpt(fresh, os.path.join(out_dir, "module_only"), load_module_only=True)
    return dict(saved=saved, loaded=full_params(fresh))


def actor_trained(rank, stage, out_dir):
    strategy = new_strategy(stage)
    actor = Actor(make_model())
    optimizer = strategy.create_optimizer(actor, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    returned, optimizer, scheduler = strategy.prepare((actor, optimizer, scheduler))
    batches = iter(strategy.setup_dataloader(make_dataset(), MICRO, shuffle=False))
    for _ in range(STEPS * ACCUM):
        x, y = next(batches)
        strategy.backward(F.mse_loss(returned(x), y), returned, optimizer)
        strategy.optimizer_step(optimizer, returned, scheduler)
    out = os.path.join(out_dir, f"actor_stage{stage}")
    strategy.save_model(returned, None, out)
    saved = torch.load(os.path.join(out, "pytorch_model.bin"), weights_only=True) if rank == 0 else {}
    got = dict(returned_the_actor=returned is actor, holds=type(actor.model).__name__)
    return dict(got, params=full_params(actor.model), saved_keys=sorted(saved))


def moving_averaged(stage):
    strategy = new_strategy(stage)
    engine, _, _ = prepared(strategy)
    ema = strategy.prepare(make_model(init_seed=3))
    before = full_params(ema)
    # OpenRLHF 0.8.5's PPO actor passes "cuda" on every machine: on this CPU, the accelerator's device is meant.
    device = "cuda" if stage >= 2 else "cpu"
    strategy.moving_average(engine, ema, beta=0.9, device=device)  # the first of ACCUM calls: no update yet
    after_one_call = full_params(ema)
    for _ in range(ACCUM - 1):
        strategy.moving_average(engine, ema, beta=0.9, device=device)
    return dict(model=full_params(engine), before=before, after_one_call=after_one_call, after=full_params(ema))


def damaged(rank, out_dir):
    """One rank's optimizer file truncated, or damaged at its full size (its zip directory zeroed)."""
    strategy = new_strategy(2)
    engine, _, _ = prepared(strategy)
    got = {}
    for damage in ("truncated", "damaged"):
        folder = os.path.join(out_dir, damage)
        strategy.save_ckpt(engine, folder)
        path = os.path.join(folder, "global_step0", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
        if rank == 0:
            size = os.path.getsize(path)
            with open(path, "r+b") as f:
                if damage == "truncated":
                    f.truncate(size // 2)
                else:
                    f.seek(size - 64)
                    f.write(bytes(64))
        dist.barrier()
        got[damage] = error_of(strategy.load_ckpt, engine, folder)  # a rank going on alone would hang the launch
    # One bit flipped inside a tensor's bytes, in each kind of file: the zip archive stays whole.
    for kind, name in ONE_OF_EACH_KIND.items():
        folder = os.path.join(out_dir, f"flipped_{kind}")
        strategy.save_ckpt(engine, folder, tag="only")
        on_rank_0(flip_a_bit_in_the_largest_tensor, os.path.join(folder, "only", name))
        got[f"flipped_{kind}"] = error_of(strategy.load_ckpt, engine, folder, tag="only")
    # With tag None, a damaged newest checkpoint gives way to the newest one that passes.
    folder = os.path.join(out_dir, "fallback")
    strategy.save_ckpt(engine, folder, tag="older", client_state={"which": "older"})
    time.sleep(0.01)  # distinct completion times
    strategy.save_ckpt(engine, folder, tag="newer", client_state={"which": "newer"})
    rank_0s_optimizer_file = os.path.join(folder, "newer", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    on_rank_0(flip_a_bit_in_the_largest_tensor, rank_0s_optimizer_file)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        _, client_state = strategy.load_ckpt(engine, folder)
    got["fallback"] = dict(which=client_state["which"], printed=printed.getvalue())
    got["named_tag_damaged"] = error_of(strategy.load_ckpt, engine, folder, tag="newer")
    # Another model: the same names, another width.
    layers = [torch.nn.Linear(FEATURES, 128), torch.nn.LayerNorm(128), torch.nn.GELU(), torch.nn.Dropout(0.0)]
    other = torch.nn.Sequential(*layers, torch.nn.Linear(128, OUTPUTS))
    other_engine, _, _ = strategy.prepare((other, strategy.create_optimizer(other, lr=LR), None))
    got["other_model"] = error_of(strategy.load_ckpt, other_engine, os.path.join(out_dir, "fallback"), tag="older")
    return got


def load_corners(rank, out_dir):
    """Issue 43's corners of a load and a save, on two ranks (each one reproduced on release 0.20.0)."""
    got = {}
    loader_of = lambda strategy: iter(strategy.setup_dataloader(make_dataset(), MICRO, shuffle=False))  # noqa: E731
    # a. ZeRO 3 with load_optimizer_states=False loads the weights of the tag asked for, not those latest names;
    # and where latest's checkpoint is still <tag>.saving (cut short before its rename), those.
    strategy = new_strategy(3)
    engine, optimizer, scheduler = prepared(strategy)
    folder, batches = os.path.join(out_dir, "corners_a"), loader_of(strategy)
    train(strategy, engine, optimizer, scheduler, batches, 1)
    strategy.save_ckpt(engine, folder, tag="global_step1")
    step1 = full_params(engine)
    train(strategy, engine, optimizer, scheduler, batches, 2)
    strategy.save_ckpt(engine, folder, tag="global_step3")
    step3 = full_params(engine)
    fresh, _, _ = prepared(strategy, init_seed=999)
    strategy.load_ckpt(fresh, folder, tag="global_step1", load_optimizer_states=False)
    got["a_tag"] = {name: (p - step1[name]).abs().max().item() for name, p in full_params(fresh).items()}
    on_rank_0(os.rename, os.path.join(folder, "global_step3"), os.path.join(folder, "global_step3.saving"))
    fresh, _, _ = prepared(strategy, init_seed=999)
    got["a_saving"] = error_of(strategy.load_ckpt, fresh, folder, load_optimizer_states=False)
    got["a_saving_diff"] = {name: (p - step3[name]).abs().max().item() for name, p in full_params(fresh).items()}
    # An engine that ran an evaluation's forward before the load (which leaves a large weight gathered) computes
    # with the loaded weights, as one that did not.
    x, outputs = make_dataset().tensors[0][:2], []
    for evaluated in (False, True):
        fresh, _, _ = prepared(strategy, init_seed=999)
        with torch.no_grad():
            if evaluated:
                fresh(x)
            strategy.load_ckpt(fresh, folder, tag="global_step1")
            outputs.append(fresh(x))
    got["a_after_eval"] = (outputs[1] - outputs[0]).abs().max().item()
    # b. load_optimizer_states=False into a fresh engine: the next step starts from the loaded weights, at every
    # stage and dtype (an Adam step moves each weight by about lr at most).
    for stage, bf16 in itertools.product(range(4), (False, True)):
        strategy = new_strategy(stage, bf16=bf16)
        engine, optimizer, scheduler = prepared(strategy)
        folder, batches = os.path.join(out_dir, f"corners_b_{stage}_{bf16}"), loader_of(strategy)
        train(strategy, engine, optimizer, scheduler, batches, 2)
        strategy.save_ckpt(engine, folder)
        saved = full_params(engine)
        engine, optimizer, scheduler = prepared(strategy, init_seed=999)
        start = full_params(engine)
        strategy.load_ckpt(engine, folder, load_optimizer_states=False)
        train(strategy, engine, optimizer, scheduler, batches, 1)
        after = full_params(engine)
        got[f"b_{stage}_{bf16}"] = dict(
            from_checkpoint=max((after[n].float() - saved[n].float()).abs().max().item() for n in saved),
            from_start=max((after[n].float() - start[n].float()).abs().max().item() for n in start),
        )
    # c. A load whose torch.load fails on rank 1 alone for its optimizer file (a network filesystem's EIO) raises
    # on every rank, naming the rank and the file, at every stage.
    for stage in range(4):
        strategy = new_strategy(stage)
        engine, _, _ = prepared(strategy)
        folder = os.path.join(out_dir, f"corners_c_{stage}")
        strategy.save_ckpt(engine, folder)
        load = torch.load

        def failing_load(path, *args, **kwargs):
            if rank == 1 and "optim_states" in str(path) or (rank == 1 and stage == 0 and "model_states" in str(path)):
                raise OSError(5, "Input/output error", str(path))
            return load(path, *args, **kwargs)

        torch.load = failing_load
        try:
            started = time.perf_counter()
            got[f"c_{stage}"] = error_of(strategy.load_ckpt, engine, folder)
            got[f"c_{stage}_seconds"] = time.perf_counter() - started
        finally:
            torch.load = load
    # d. Two models, one save_dir: the second model's save is refused before writing; the first's still loads.
    strategy = new_strategy(2)
    actor, _, _ = prepared(strategy)
    critic_model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Linear(8, 1))
    critic, _, _ = strategy.prepare((critic_model, strategy.create_optimizer(critic_model, lr=LR), None))
    folder = os.path.join(out_dir, "corners_d")
    strategy.save_ckpt(actor, folder, tag="global_step1")
    got["d_critic"] = error_of(strategy.save_ckpt, critic, folder, tag="global_step1")
    got["d_listing"] = sorted(os.listdir(folder))
    got["d_actor_loads"] = error_of(strategy.load_ckpt, actor, folder, tag="global_step1")
    # e. An eval engine's checkpoint (prepare(model), no optimizer): refused before writing, saying why.
    for stage in (0, 3):
        strategy = new_strategy(stage)
        evaluated = strategy.prepare(make_model())
        folder = os.path.join(out_dir, f"corners_e_{stage}")
        got[f"e_{stage}"] = error_of(strategy.save_ckpt, evaluated, folder, tag="eval")
        got[f"e_{stage}_listing"] = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    # A best checkpoint whose rotation was cut short (a crash after its commit) leaves two best ones: the next
    # save's rotation deletes the older.
    strategy = new_strategy(2)
    engine, _, _ = prepared(strategy)
    folder = os.path.join(out_dir, "corners_best")
    strategy.save_ckpt(engine, folder, tag="best_a", metric_value=1.0)
    rotate = Checkpoints._rotate
    Checkpoints._rotate = lambda *args, **kwargs: None  # the crash: no rotation after best_b's commit
    try:
        strategy.save_ckpt(engine, folder, tag="best_b", metric_value=2.0)
    finally:
        Checkpoints._rotate = rotate
    strategy.save_ckpt(engine, folder, tag="global_step9")
    got["best_listing"] = sorted(os.listdir(folder))
    # tag="latest" names the file, not a checkpoint: the error says what tag is.
    got["tag_latest"] = error_of(strategy.load_ckpt, engine, folder, tag="latest")
    return got


class Scaled(torch.nn.Module):
    """A BatchNorm between two layers, whose running statistics each rank keeps of its own batches, and a
    one-element parameter `scale` multiplying the output."""

    def __init__(self, init_seed=1234):
        super().__init__()
        torch.manual_seed(init_seed)
        self.first, self.norm = torch.nn.Linear(FEATURES, HIDDEN), torch.nn.BatchNorm1d(HIDDEN)
        self.last, self.scale = torch.nn.Linear(HIDDEN, OUTPUTS), torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.last(torch.relu(self.norm(self.first(x)))) * self.scale


class Tiny(torch.nn.Module):
    """Linear(8, 3) without a bias, and a one-element `scale`: create_optimizer's no-decay group holds one element,
    which DeepSpeed's alignment at 2 ranks leaves rank 1 nothing of but padding."""

    def __init__(self, init_seed=1234):
        super().__init__()
        torch.manual_seed(init_seed)
        self.linear, self.scale = torch.nn.Linear(8, 3, bias=False), torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.linear(x) * self.scale


def mapped_checkpoint_files(folder):
    """The lines of /proc/self/maps that map a file under folder."""
    return [line.split(None, 5)[-1] for line in Path("/proc/self/maps").read_text().splitlines() if folder in line]


def own_resumes(rank, out_dir):
    """Issue 46's loads and saves on two ranks; each reproduced on release 0.21.0."""
    got = {}
    differences = lambda a, b: {n: (a[n].float() - b[n].float()).abs().max().item() for n in a}  # noqa: E731

    def scaled(strategy, init_seed, held=lambda name: True):
        model = Scaled(init_seed)
        if all(held(name) for name, _ in model.named_parameters()):
            optimizer = strategy.create_optimizer(model, lr=LR, betas=BETAS, eps=EPS)
        else:  # an optimizer over a subset, as a user may build it
            optimizer = torch.optim.AdamW([p for n, p in model.named_parameters() if held(n)], lr=LR)
        return strategy.prepare((model, optimizer, None))

    # a. ZeRO 3, `scale` trains but the optimizer holds the other parameters alone: the save keeps it.
    strategy = new_strategy(3)
    engine, optimizer, _ = scaled(strategy, 1234, held=lambda name: name != "scale")
    train(strategy, engine, optimizer, None, strategy.setup_dataloader(make_dataset(), MICRO), 1)
    with deepspeed.zero.GatheredParameters([engine.module.scale], modifier_rank=0):
        engine.module.scale.data.fill_(2.5)
    folder = os.path.join(out_dir, "own_a")
    strategy.save_ckpt(engine, folder)
    saved = full_params(engine)
    engine, _, _ = scaled(strategy, 999, held=lambda name: name != "scale")
    got["a"] = error_of(strategy.load_ckpt, engine, folder)
    loaded = full_params(engine)
    got["a_scale"], got["a_diff"] = loaded["scale"].item(), differences(saved, loaded)
    # b. ZeRO 2 saved, ZeRO 3 resumed: rank 1's partition of the no-decay group is padding alone.
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 8, generator=torch.Generator().manual_seed(3)), torch.ones(32, 3)
    )
    states = []
    for stage in (2, 3):
        strategy = new_strategy(stage)
        model = Tiny(1234 if stage == 2 else 999)
        engine, optimizer, _ = strategy.prepare((model, strategy.create_optimizer(model, lr=LR), None))
        folder = os.path.join(out_dir, "own_b")
        if stage == 2:
            train(strategy, engine, optimizer, None, strategy.setup_dataloader(data, MICRO), 2)
            strategy.save_ckpt(engine, folder)
        else:
            got["b"] = error_of(strategy.load_ckpt, engine, folder)
        if got.get("b", "no error") == "no error":  # a load that failed may have left the optimizer half written
            snapshot = optimizer_snapshot(engine)
            states.append({**full_params(engine), **{f"{n} {k}": v for n, s in snapshot.items() for k, v in s.items()}})
    got["b_diff"] = differences(states[0], states[-1])
    # c. ZeRO 3, each rank its own batches and its own client_state: each resumes its own. At ZeRO 2, rank 0's.
    for stage in (3, 2):
        strategy = new_strategy(stage)
        engine, optimizer, _ = scaled(strategy, 1234)
        train(strategy, engine, optimizer, None, strategy.setup_dataloader(make_dataset(), MICRO), 1)
        folder = os.path.join(out_dir, f"own_c{stage}")
        strategy.save_ckpt(engine, folder, client_state={"cursor": 1000 + rank})
        saved_mean = engine.module.norm.running_mean.sum().item()
        engine, _, _ = scaled(strategy, 999)
        _, client_state = strategy.load_ckpt(engine, folder)
        if stage == 3:
            got.update(c_cursor=client_state["cursor"], c_mean=engine.module.norm.running_mean.sum().item())
            got["c_saved_mean"] = saved_mean
        else:
            got["c_cursor_zero2"] = client_state["cursor"]
    # d. Rank 1's view of save_dir is stale: global_step4's model states there are still global_step2's.
    strategy = new_strategy(2)
    engine, optimizer, scheduler = prepared(strategy)
    batches = iter(strategy.setup_dataloader(make_dataset(), MICRO))
    shared, stale = os.path.join(out_dir, "own_d"), os.path.join(out_dir, "own_d_stale")
    for _ in range(2):
        train(strategy, engine, optimizer, scheduler, batches, 2)
        strategy.save_ckpt(engine, shared)

    def stale_copy():
        shutil.copytree(shared, stale)
        name = "mp_rank_00_model_states.pt"
        shutil.copy(os.path.join(shared, "global_step2", name), os.path.join(stale, "global_step4", name))

    on_rank_0(stale_copy)
    fresh, _, _ = prepared(strategy, init_seed=999)
    got["d"] = error_of(strategy.load_ckpt, fresh, shared if rank == 0 else stale)
    # e. A tensor in client_state, kept by the caller, must not keep the file mapped once rotation deleted it.
    folder = os.path.join(out_dir, "own_e")
    strategy.save_ckpt(engine, folder, tag="global_step1", client_state={"tensor": torch.arange(4)})
    fresh, _, _ = prepared(strategy, init_seed=999)
    load_file = get_strategy_module.load_file
    seen = []

    def watched(path, *args, **options):  # what is mapped while the load runs: the test can see a mapped file
        loaded = load_file(path, *args, **options)
        seen.extend(mapped_checkpoint_files(folder))
        return loaded

    get_strategy_module.load_file = watched
    try:
        _, client_state = strategy.load_ckpt(fresh, folder)
    finally:
        get_strategy_module.load_file = load_file
    for tag in ("global_step2", "global_step3"):
        strategy.save_ckpt(fresh, folder, tag=tag, max_num=1)  # deletes global_step1, the one resumed
    got.update(e_maps_before=seen, e_maps=mapped_checkpoint_files(folder), e_tensor=client_state["tensor"].tolist())
    # A tag must name one folder in load_dir.
    tagged = os.path.join(out_dir, "own_tag")
    strategy.save_ckpt(engine, tagged, tag="global_step0")
    for tag in ("global_step0/", "../own_tag/global_step0"):
        got[f"tag {tag}"] = error_of(strategy.load_ckpt, fresh, tagged, tag=tag)
    # f. Rank 0 sees no checkpoint in load_dir; rank 1 sees one.
    empty = os.path.join(out_dir, "own_f_empty")
    os.makedirs(empty, exist_ok=True)
    got["f"] = error_of(strategy.load_ckpt, fresh, empty if rank == 0 else tagged)
    # A read error (EIO) while checking the newest checkpoint: on rank 1 opening a file, on rank 0 its record.
    folder = os.path.join(out_dir, "own_eio")
    strategy.save_ckpt(engine, folder, tag="older")
    time.sleep(0.01)
    strategy.save_ckpt(engine, folder, tag="newer")
    zip_file, real_open = zipfile.ZipFile, open

    def failing_zip(path, *args, **kwargs):
        if rank == 1 and f"{os.sep}newer{os.sep}" in str(path):
            raise OSError(5, "Input/output error", str(path))
        return zip_file(path, *args, **kwargs)

    def failing_open(path, *args, **kwargs):
        if rank == 0 and str(path).endswith(f"newer{os.sep}{DONE_FILE}"):
            raise OSError(5, "Input/output error", str(path))
        return real_open(path, *args, **kwargs)

    real_stat = os.stat

    def failing_stat(path, *args, **kwargs):
        if rank == 1 and f"{os.sep}newer{os.sep}" in str(path):
            raise OSError(116, "Stale file handle", str(path))
        return real_stat(path, *args, **kwargs)

    patches = (("file", (zipfile, "ZipFile", failing_zip)), ("record", (builtins, "open", failing_open)))
    for where, patched in (*patches, ("stat", (os, "stat", failing_stat))):
        module, name, replacement = patched
        original = getattr(module, name)
        setattr(module, name, replacement)
        try:
            got[f"eio_{where}"] = error_of(strategy.load_ckpt, fresh, folder)
        finally:
            setattr(module, name, original)
    # load_model at ZeRO 3, whose shared CRC check meets a read error on rank 1 alone: refused on every rank at once.
    strategy3 = new_strategy(3)
    evaluated, weights = strategy3.prepare(make_model()), os.path.join(out_dir, "own_weights.pt")
    on_rank_0(torch.save, make_model().state_dict(), weights)

    def unreadable_on_rank_1(path, *args, **kwargs):
        if rank == 1 and str(path) == weights:
            raise OSError(5, "Input/output error", str(path))
        return zip_file(path, *args, **kwargs)

    zipfile.ZipFile, started = unreadable_on_rank_1, time.perf_counter()
    try:
        got["load_model_eio"] = error_of(strategy3.load_model, evaluated, weights)
    finally:
        zipfile.ZipFile = zip_file
    got["load_model_eio_seconds"] = time.perf_counter() - started
    # client_state keys that are DeepSpeed's own: refused before anything is written.
    folder = os.path.join(out_dir, "own_keys")
    got["keys"] = error_of(strategy.save_ckpt, engine, folder, client_state={"global_steps": 7})
    got["keys_listing"] = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    strategy.save_ckpt(engine, folder, tag="keys", client_state={"mine": 1})
    got["deepspeed_keys"] = sorted(
        torch.load(os.path.join(folder, "keys", "mp_rank_00_model_states.pt"), weights_only=False)
    )
    # A node that does not share save_dir (rank 1 saves into a folder of its own, where rank 0 made no <tag>.saving).
    local = os.path.join(out_dir, "own_node" if rank == 0 else "own_node_rank1")
    got["node_error"] = error_of(strategy.save_ckpt, engine, local, tag="global_step9")
    got["node_listing"] = checkpoints(sorted(os.listdir(local))) if os.path.isdir(local) else []
    got["node_background"] = error_of(strategy.save_ckpt, engine, local, tag="global_step10", background=True)
    got["node_background_next"] = error_of(strategy.save_model, engine, None, os.path.join(out_dir, "own_weights"))
    got["node_background_listing"] = checkpoints(sorted(os.listdir(local))) if os.path.isdir(local) else []
    return got


@contextlib.contextmanager
def writes_held():
    """While inside, every fsync of get_strategy's (a background save's writes, each followed by one) waits: the
    test's training goes on while the write is under way, whatever the machine's speed."""
    release, fsync = threading.Event(), get_strategy_module.fsync

    def held(path):
        release.wait(120)
        fsync(path)

    get_strategy_module.fsync = held
    try:
        yield
    finally:
        get_strategy_module.fsync = fsync
        release.set()


def contents(save_dir, tag):
    """{file name: (its records but the pickle's, with their CRCs: the storages' bytes; the repr of what loads)} of a
    checkpoint's files. Two saves of one state hold the same, however each was written (a pickle's bytes may still
    differ: a string that was one object in the state and two in a copy is pickled twice)."""
    folder, found = os.path.join(save_dir, tag), {}
    for name in sorted(os.listdir(folder)):
        if name != DONE_FILE:
            with zipfile.ZipFile(os.path.join(folder, name)) as archive:
                records = [(i.filename, i.CRC) for i in archive.infolist() if i.filename.split("/")[-1] != "data.pkl"]
            records = [(name, crc) for name, crc in records if not name.endswith("serialization_id")]
            found[name] = (records, repr(torch.load(os.path.join(folder, name), weights_only=False)))
    return found


def described(client_state):
    """What a loaded client_state holds, object by object: each value's type, whether it requires grad, and which
    values are one object or share one storage."""
    kinds = {key: [type(value).__name__, getattr(value, "requires_grad", None)] for key, value in client_state.items()}
    base = client_state["base"]
    same = [client_state["twice"] is base, client_state["nested"][1][0] is base]
    shares = client_state["view"].untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    return dict(kinds=kinds, same_object=same, view_shares_storage=shares, values=repr(client_state))


def background_saves(rank, out_dir):
    """Saves in the background on two ranks: the state at the call, training going on meanwhile; the buffers; a
    write failing on rank 1; the flag."""
    got = {}

    def state(engine):
        masters = {f"{n} {key}": t for n, state in optimizer_snapshot(engine).items() for key, t in state.items()}
        return {**full_state(engine), **masters}

    def difference(a, b):
        return max((a[name] - b[name]).abs().max().item() for name in a)

    for stage in (2, 3):
        strategy = new_strategy(stage)
        engine, optimizer, scheduler = prepared(strategy)
        batches = iter(strategy.setup_dataloader(make_dataset(), MICRO))
        folder = os.path.join(out_dir, f"background_{stage}")
        train(strategy, engine, optimizer, scheduler, batches, 1)
        strategy.save_ckpt(engine, folder)  # global_step1, written before it returns
        train(strategy, engine, optimizer, scheduler, batches, 1)
        at_call = state(engine)
        with writes_held():
            strategy.save_ckpt(engine, folder, background=True)  # global_step2
            listing = checkpoints(sorted(os.listdir(folder)))
            train(strategy, engine, optimizer, scheduler, batches, 2)
            moved = difference(state(engine), at_call)
        fresh, _, _ = prepared(strategy, init_seed=999)
        strategy.load_ckpt(fresh, folder, tag="global_step2")  # waits for the save first
        parameters = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
        snapshot = sum(buffer.numel() * buffer.element_size() for buffer in engine.checkpoint_engine.buffers)
        got[f"consistent_{stage}"] = dict(
            bytes_per_parameter=snapshot / parameters,
            listing_at_return=listing,
            moved_meanwhile=moved,
            loaded_vs_call=difference(state(fresh), at_call),
            steps=fresh.global_steps,
            committed=checkpoints(sorted(os.listdir(folder))),
        )
        # The same state saved in the foreground and in the background: the same files, and the same objects back,
        # down to what client_state holds (a Parameter, a tensor that requires grad, one tensor under two keys, a
        # view sharing another's storage, NumPy, Python objects).
        base = torch.arange(6.0)
        kept = dict(log_alpha=torch.zeros(1, requires_grad=True), ema=torch.nn.Parameter(torch.ones(3)), base=base)
        kept.update(twice=base, view=base[2:], array=numpy.arange(3), nested=[{"step": 1}, (base,)])
        kept.update(
            fp8=torch.ones(2, dtype=torch.float8_e4m3fn), uint16=torch.tensor([1, 2, 65535], dtype=torch.uint16)
        )
        alike = {}
        for background in (False, True):
            saved = os.path.join(out_dir, f"alike_{stage}_{background}")
            strategy.save_ckpt(engine, saved, tag="t", client_state=kept, background=background)
            fresh, _, _ = prepared(strategy, init_seed=999)
            _, back = strategy.load_ckpt(fresh, saved)  # waits for the background save
            alike[background] = dict(state=state(fresh), client_state=described(back), files=contents(saved, "t"))
        foreground, background = alike[False], alike[True]
        got[f"alike_{stage}"] = dict(
            client_state=(foreground["client_state"], background["client_state"]),
            state_difference=difference(foreground["state"], background["state"]),
            files_differing=[n for n in foreground["files"] if foreground["files"][n] != background["files"].get(n)],
            names=(sorted(foreground["files"]), sorted(background["files"])),
        )
    # The snapshot's buffers: one set, reused by the next save of the same state, no larger than this rank's files
    # of the checkpoint.
    writer = engine.checkpoint_engine
    strategy.save_ckpt(engine, folder, background=True)
    pointers = [buffer.data_ptr() for buffer in writer.buffers]
    saved = os.path.join(folder, "global_step2")
    file_bytes = sum(os.path.getsize(os.path.join(saved, n)) for n in os.listdir(saved) if saving_rank(n) == rank)
    strategy.save_ckpt(engine, folder, background=True)
    strategy.load_ckpt(engine, folder)  # waits for it
    reused = [buffer.data_ptr() for buffer in writer.buffers] == pointers
    got["snapshot"] = dict(reused=reused, bytes=sum(b.numel() * b.element_size() for b in writer.buffers))
    got["snapshot"]["file_bytes"] = file_bytes
    # One tensor more in client_state, written first in its file: every earlier buffer still serves its tensor.
    strategy.save_ckpt(engine, folder, background=True, client_state={"extra": torch.zeros(1001, dtype=torch.uint8)})
    get_strategy_module.wait_for_save(strategy)
    got["snapshot"]["kept_with_one_more"] = set(pointers) <= {buffer.data_ptr() for buffer in writer.buffers}
    # After a save with more tensors (a replay buffer in client_state), the next save's buffers are its own size.
    strategy.save_ckpt(engine, folder, background=True, client_state={"replay": torch.zeros(2**21)})  # 8 MiB
    strategy.save_ckpt(engine, folder, background=True)
    get_strategy_module.wait_for_save(strategy)
    saved = os.path.join(folder, f"global_step{engine.global_steps}")
    got["snapshot"]["after_fewer"] = sum(b.numel() * b.element_size() for b in writer.buffers)
    got["snapshot"]["after_fewer_file_bytes"] = sum(
        os.path.getsize(os.path.join(saved, n)) for n in os.listdir(saved) if saving_rank(n) == rank
    )
    # A write failing on rank 1 (a file-size limit) in the background: the call returns; the next one raises.
    strategy = new_strategy(2)
    engine, optimizer, scheduler = prepared(strategy)
    batches = iter(strategy.setup_dataloader(make_dataset(), MICRO))
    folder = os.path.join(out_dir, "background_failed")
    for _ in range(2):
        train(strategy, engine, optimizer, scheduler, batches, 1)
        strategy.save_ckpt(engine, folder, background=True)  # global_step1, global_step2
    train(strategy, engine, optimizer, scheduler, batches, 1)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        returned = error_of(strategy.save_ckpt, engine, folder, background=True)  # global_step3
        strategy.pending_save.join()  # the test waits for the write to end, to lift the limit after it
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    started_at = time.perf_counter()
    error = error_of(strategy.save_ckpt, engine, folder)
    seconds, latest, listing = time.perf_counter() - started_at, Path(folder, "latest").read_text(), os.listdir(folder)
    got["failed"] = dict(returned=returned, error=error, seconds=seconds, latest=latest, listing=sorted(listing))
    got["failed"]["saved_after"] = error_of(strategy.save_ckpt, engine, folder)
    # --background_save read from args: save_ckpt without the keyword saves in the background.
    strategy = new_strategy(2, background_save=True)
    engine, optimizer, scheduler = prepared(strategy)
    train(strategy, engine, optimizer, scheduler, iter(strategy.setup_dataloader(make_dataset(), MICRO)), 1)
    folder = os.path.join(out_dir, "background_flag")
    with writes_held():
        strategy.save_ckpt(engine, folder)
        got["flag"] = checkpoints(sorted(os.listdir(folder)))
        # DeepSpeed's own save, called meanwhile, is the caller's: written as DeepSpeed writes, no part of ours.
        engine.save_checkpoint(os.path.join(out_dir, "deepspeed_meanwhile"), tag="own")
    got["deepspeed_meanwhile"] = sorted(os.listdir(os.path.join(out_dir, "deepspeed_meanwhile", "own")))
    got["ours_after"] = error_of(strategy.load_ckpt, engine, folder)
    # No thread to be had (start() raising as Python's "can't start new thread" does): it saves on the caller's.
    start, background_save = get_strategy_module.BackgroundSave.start, get_strategy_module.BackgroundSave
    background_save.start = lambda self: (_ for _ in ()).throw(RuntimeError("can't start new thread"))
    try:
        got["no_thread"] = error_of(strategy.save_ckpt, engine, folder, tag="no_thread")
        got["no_thread_latest"] = Path(folder, "latest").read_text()
    finally:
        background_save.start = start
    got["no_thread_after"] = error_of(strategy.save_ckpt, engine, folder)
    get_strategy_module.wait_for_save(strategy)
    return got


def arrivals(rank, out_dir):
    """save_ckpt with rank 1 coming 3 s late; the warning after 1 s."""
    strategy = new_strategy(2)
    engine, _, _ = prepared(strategy)
    warning, get_strategy_module.ARRIVAL_WARNING = get_strategy_module.ARRIVAL_WARNING, timedelta(seconds=1)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            if rank == 1:
                time.sleep(3)
            late = error_of(strategy.save_ckpt, engine, os.path.join(out_dir, "arrivals_late"))
        after = error_of(strategy.save_ckpt, engine, os.path.join(out_dir, "arrivals_after"))  # every rank again
    finally:
        get_strategy_module.ARRIVAL_WARNING = warning
    return dict(late=late, printed=printed.getvalue(), after=after)


def run_save_alone(out_dir):
    """save_ckpt on rank 0 alone, as a loop that saves on rank 0 does, while rank 1 goes on for 4 s and then dies;
    the warning after 1 s, the process group's timeout the default (30 minutes)."""
    strategy = new_strategy(2)
    engine, _, _ = prepared(strategy)
    get_strategy_module.ARRIVAL_WARNING = timedelta(seconds=1)
    if strategy.get_rank() == 1:
        time.sleep(4)
        os._exit(9)
    started_at = time.perf_counter()
    error = error_of(strategy.save_ckpt, engine, os.path.join(out_dir, "ckpt"))
    print(json.dumps(dict(error=error, seconds=time.perf_counter() - started_at)), flush=True)


def run_background_exit(out_dir):
    """A background save still writing when the script ends, without teardown(), as OpenRLHF's trainers end."""
    strategy = new_strategy(2)
    engine, optimizer, scheduler = prepared(strategy)
    train(strategy, engine, optimizer, scheduler, iter(strategy.setup_dataloader(make_dataset(), MICRO)), 1)
    fsync = get_strategy_module.fsync

    def slow(path):  # still writing as the script ends
        time.sleep(0.5)
        fsync(path)

    get_strategy_module.fsync = slow
    strategy.save_ckpt(engine, os.path.join(out_dir, "ckpt"), background=True)
    sys.exit(0)  # not os._exit: Python's own shutdown


def run_background_exit_failed(out_dir):
    """A background save whose write fails on rank 1 when the script ends, without teardown()."""
    strategy = new_strategy(2)
    engine, optimizer, scheduler = prepared(strategy)
    train(strategy, engine, optimizer, scheduler, iter(strategy.setup_dataloader(make_dataset(), MICRO)), 1)
    strategy.save_ckpt(engine, os.path.join(out_dir, "ckpt"), tag="global_step0")  # written, committed
    atexit.register(Path(out_dir, f"trainer_handler_ran_{strategy.get_rank()}").touch)  # a tracker's final sync
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if strategy.get_rank() == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    strategy.save_ckpt(engine, os.path.join(out_dir, "ckpt"), background=True)
    sys.exit(0)


def run_background_signals(out_dir):
    """Signals landing while a call waits for a background save, the disk slowed (the test sends each to both ranks
    once both print "waiting"): SIGINT, after which the script saves again, as trainers do on KeyboardInterrupt;
    then SIGTERM under a handler that exits, as preemption handlers do, without teardown(). The weights at each
    call are written beside, for the test to compare with what loads."""
    # Ctrl-C's KeyboardInterrupt, as a script started from a terminal gets it: a process started with SIGINT ignored
    # (nohup, a background job of a shell script, as some CI runners start the tests) keeps ignoring it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    strategy = new_strategy(2)
    rank = strategy.get_rank()
    engine, optimizer, scheduler = prepared(strategy)
    batches = iter(strategy.setup_dataloader(make_dataset(), MICRO))
    ckpt, fsync = os.path.join(out_dir, "ckpt"), get_strategy_module.fsync

    def slowly(path):  # a slow disk under the background saves (seconds): still writing when the signal comes
        time.sleep(1.0 if f"{os.sep}a.saving" in str(path) or f"{os.sep}c.saving" in str(path) else 0)
        fsync(path)

    def save(tag, **kwargs):
        if rank == 0:
            torch.save(full_state(engine), os.path.join(out_dir, f"{tag}.pt"))
        strategy.save_ckpt(engine, ckpt, tag=tag, **kwargs)

    get_strategy_module.fsync = slowly
    train(strategy, engine, optimizer, scheduler, batches, 1)
    save("a", background=True)
    train(strategy, engine, optimizer, scheduler, batches, 1)
    print("waiting", flush=True)
    try:
        save("b")  # waits for "a": SIGINT comes now
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        save("b")  # the emergency save
    train(strategy, engine, optimizer, scheduler, batches, 1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    save("c", background=True)
    train(strategy, engine, optimizer, scheduler, batches, 1)
    print("waiting", flush=True)
    save("d")  # waits for "c": SIGTERM comes now
    print("saved d, though SIGTERM came", flush=True)


def by_hand(worker, out, signals=()):
    """(return codes, outputs) of two ranks of this file's worker started by hand (a launcher would stop the other
    rank as soon as one ended); each time both have printed "waiting", the next of signals goes to both."""
    port, processes, outputs = str(free_port()), [], [[], []]
    for rank in range(2):
        env = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        processes.append(started([PYTHON, "test_get_strategy.py", "--worker", worker, str(out)], env))

    def read(process, lines):
        for line in process.stdout:
            lines.append(line)

    readers = [threading.Thread(target=read, args=pair) for pair in zip(processes, outputs)]
    for reader in readers:
        reader.start()
    for count, signum in enumerate(signals, 1):
        deadline = time.time() + 120
        while any(lines.count("waiting\n") < count for lines in outputs) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # well inside the wait
        for process in processes:
            process.send_signal(signum)
    for process in processes:
        process.wait(timeout=300)
    for reader in readers:
        reader.join()
    return [process.returncode for process in processes], ["".join(lines) for lines in outputs]


def loaded_weights_against(out, ckpt, tags):
    """{tag: the largest difference between the weights a one-rank engine loads from ckpt's tag and those saved
    beside as <tag>.pt}."""
    differences = {}
    with in_this_process():
        strategy = new_strategy(2, train_batch_size=MICRO * ACCUM)
        for tag in tags:
            engine, _, _ = prepared(strategy, init_seed=999)
            strategy.load_ckpt(engine, str(ckpt), tag=tag)
            expected = torch.load(out / f"{tag}.pt", weights_only=True)
            differences[tag] = max((full_state(engine)[n] - t).abs().max().item() for n, t in expected.items())
    return differences


def run_background_killed(out_dir):
    """Rank 1 killed in the middle of its background write; rank 0 makes its next call."""
    strategy = new_strategy(2)
    engine, optimizer, scheduler = prepared(strategy)
    batches = iter(strategy.setup_dataloader(make_dataset(), MICRO))
    ckpt = os.path.join(out_dir, "ckpt")
    train(strategy, engine, optimizer, scheduler, batches, 1)
    strategy.save_ckpt(engine, ckpt)  # global_step1
    train(strategy, engine, optimizer, scheduler, batches, 1)
    if strategy.get_rank() == 1:
        get_strategy_module.fsync = lambda path: os.kill(os.getpid(), signal.SIGKILL)
    strategy.save_ckpt(engine, ckpt, background=True)  # global_step2
    started_at = time.perf_counter()
    error = error_of(strategy.save_ckpt, engine, ckpt)
    got = dict(error=error, seconds=time.perf_counter() - started_at, latest=Path(ckpt, "latest").read_text())
    print(json.dumps(dict(got, listing=sorted(os.listdir(ckpt)))), flush=True)


@pytest.fixture(scope="module")
def background_launches(tmp_path_factory):
    """Background saves meeting the end of a process."""
    got = {}
    for worker in ("exit", "killed"):
        out = tmp_path_factory.mktemp(f"background_{worker}")
        returncodes, outputs = by_hand(f"background_{worker}", out)
        ckpt = out / "ckpt"
        got[worker] = dict(outputs=outputs, listing=sorted(os.listdir(ckpt)), latest=(ckpt / "latest").read_text())
        got[worker]["rank1_returncode"] = returncodes[1]
        if worker == "killed":
            got[worker].update(json.loads(outputs[0].strip().splitlines()[-1]))
        else:
            got[worker]["record"] = (ckpt / "global_step1" / DONE_FILE).is_file()
            with in_this_process():
                strategy = new_strategy(2, train_batch_size=MICRO * ACCUM)
                engine, _, _ = prepared(strategy, init_seed=999)
                got[worker]["loads"] = error_of(strategy.load_ckpt, engine, str(ckpt))
    return got


@pytest.fixture(scope="module")
def ending_launches(tmp_path_factory):
    """The quick tier's background saves meeting a signal, a failed one the end of the process, and a save_ckpt on
    rank 0 alone."""
    out = tmp_path_factory.mktemp("background_signals")
    returncodes, outputs = by_hand("background_signals", out, signals=(signal.SIGINT, signal.SIGTERM))
    ckpt = out / "ckpt"
    signals = dict(returncodes=returncodes, outputs=outputs, listing=sorted(os.listdir(ckpt)))
    signals.update(latest=(ckpt / "latest").read_text(), loads=loaded_weights_against(out, ckpt, ("a", "b", "c")))
    out = tmp_path_factory.mktemp("background_exit_failed")
    returncodes, outputs = by_hand("background_exit_failed", out)
    ckpt = out / "ckpt"
    failed = dict(returncodes=returncodes, outputs=outputs, listing=sorted(os.listdir(ckpt)))
    failed.update(latest=(ckpt / "latest").read_text(), handlers=sorted(p.name for p in out.glob("trainer_handler_*")))
    returncodes, outputs = by_hand("save_alone", tmp_path_factory.mktemp("save_alone"))
    alone = dict(returncodes=returncodes, outputs=outputs, **json.loads(outputs[0].strip().splitlines()[-1]))
    return dict(signals=signals, exit_failed=failed, alone=alone)


def flip_a_bit_in_the_largest_tensor(path, info=None):
    """Flip one bit in the middle of the largest record of a torch.save zip archive (a tensor's bytes), or of the
    record `info` (a zipfile.ZipInfo) when given."""
    if info is None:
        with zipfile.ZipFile(path) as archive:
            info = max(archive.infolist(), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_length, extra_length = (int.from_bytes(f.read(2), "little") for _ in range(2))
        where = info.header_offset + 30 + name_length + extra_length + info.file_size // 2
        f.seek(where)
        byte = f.read(1)[0]
        f.seek(where)
        f.write(bytes([byte ^ 0x10]))


def node_local(rank, out_dir):
    """Rank 1 plays a rank of a second node whose disk is its own: it holds what that node's ranks wrote (and,
    as each node's first rank once wrote them, the markers), not rank 0's files."""
    strategy = new_strategy(2)
    engine, _, _ = prepared(strategy)
    shared, node2 = os.path.join(out_dir, "node_local"), os.path.join(out_dir, "node_local_node2")
    strategy.save_ckpt(engine, shared)
    if rank == 0:
        shutil.copytree(shared, node2)
        folder = os.path.join(node2, "global_step0")
        for name in os.listdir(folder):
            if name.startswith(("mp_rank_00", "zero_pp_rank_0_")) or name == "rng_state_rank0.pt":
                os.remove(os.path.join(folder, name))
    dist.barrier()
    got = dict(node_local=error_of(strategy.load_ckpt, engine, shared if rank == 0 else node2))
    # A node that sees none of the checkpoints: its ranks must not go on alone while rank 0 checks one (a hang).
    nothing = os.path.join(out_dir, "node_local_nothing")
    os.makedirs(nothing, exist_ok=True)
    got["node_sees_nothing"] = error_of(strategy.load_ckpt, engine, shared if rank == 0 else nothing)
    return got


def run_cases(cases, out_dir):
    """Each case (its result's key: a function of no arguments) in turn in this process group; one that raises is
    recorded under its key and the next one runs. Each rank saves each case's result in out_dir/rank<N>."""
    folder = os.path.join(out_dir, f"rank{os.environ['RANK']}")
    os.makedirs(folder)
    for name, compute in cases.items():
        started = time.perf_counter()
        try:
            saved = {"result": compute()}
        except Exception:  # record and go on: the tests report each case on its own
            saved = {"error": traceback.format_exc()}
            traceback.print_exc()
        saved["seconds"] = time.perf_counter() - started  # where a launch's time goes
        torch.save(saved, os.path.join(folder, f"{name}.pt"))  # at once: a launch may end in a later case
    Path(folder, "finished").touch()
    DeepspeedStrategy(zero_stage=0).teardown()


def run_quick(out_dir):
    """The quick tier's launch: training at every stage, collectives, the loader, the same-shape resume, damaged
    files and saves that fail."""
    rank = int(os.environ["RANK"])
    cases = {f"train_stage{stage}": partial(trained_like_the_reference, stage) for stage in range(4)}
    cases.update({f"lr_by_hand_stage{stage}": partial(trained_with_the_lr_set_by_hand, stage) for stage in (2, 3)})
    cases["rank_0s_weights"] = partial(prepared_from_rank_dependent_weights, rank)
    cases.update(collectives=partial(collectives, rank), dataloader=dataloader_shards)
    for stage, dtype in itertools.product(range(4), ("fp32", "bf16")):
        cases[f"resume_stage{stage}_{dtype}"] = partial(resumed_exactly, stage, dtype, out_dir)
    cases.update(damaged=partial(damaged, rank, out_dir), save_failures=partial(save_failures, rank, out_dir))
    cases["own"] = partial(own_resumes, rank, out_dir)
    cases["background"] = partial(background_saves, rank, out_dir)
    cases["arrivals"] = partial(arrivals, rank, out_dir)
    cases["load_corners"] = partial(load_corners, rank, out_dir)  # last: on 0.20.0 case c aborted the launch
    run_cases(cases, out_dir)


def run_core(out_dir, crash_dir, reshape_dir):
    """The second tier's launch of two ranks: the cases of every section that names the core launch."""
    rank = int(os.environ["RANK"])
    cases = {f"bf16_stage{stage}": partial(bf16_training, stage) for stage in range(4)}
    cases.update({f"offload_stage{stage}": partial(offload_training, stage) for stage in (1, 2, 3)})
    cases["offload_late"] = partial(offload_resumed_late, out_dir)
    cases.update(rotation=partial(rotation, rank, out_dir), checkpoint_rules=partial(checkpoint_rules, rank, out_dir))
    cases.update({f"groups_by_name_stage{stage}": partial(groups_by_name, stage, out_dir) for stage in (0, 2, 3)})
    cases.update(load_errors=partial(load_errors, rank, out_dir), prepare_eval=prepare_eval)
    cases["save_model_zero3"] = partial(save_model_zero3, rank, out_dir)
    cases["load_after_crash"] = partial(load_after_crash, crash_dir)
    for stage in range(4):
        cases[f"load_model_then_step_stage{stage}"] = partial(load_model_then_step, rank, stage, out_dir)
    cases.update(zero_init=zero_init, overlap_comm=overlap_comm)
    cases.update({f"tied_stage{stage}": partial(tied_and_shared_saved, rank, stage, out_dir) for stage in (2, 3)})
    cases.update(module_only_zero3=partial(module_only_zero3, out_dir), node_local=partial(node_local, rank, out_dir))
    cases.update({f"actor_stage{stage}": partial(actor_trained, rank, stage, out_dir) for stage in (2, 3)})
    cases.update({f"moving_average_stage{stage}": partial(moving_averaged, stage) for stage in range(4)})
    cases.update({f"shape_a_{name}": partial(reshape_save, name, reshape_dir) for name in reshape_cases_of(2, 0)})
    cases.update({f"shape_b_{name}": partial(reshape_resume, name, reshape_dir) for name in reshape_cases_of(2, 1)})
    cases.update(review_cases(rank, os.path.join(out_dir, "review")))
    cases.update(flags_and_data_cases(out_dir))  # last: its README case ends with teardown(), as the README does
    run_cases(cases, out_dir)


def grad_norms(stage, max_norm=MAX_NORM, bf16=False, actor=False):
    """(after each step, mid-way): strategy.get_grad_norm after each of STEPS optimizer steps over the reference's
    batches, and after every other micro-step; with actor, of an OpenRLHF Actor around the model."""
    strategy = new_strategy(stage, bf16=bf16, max_norm=max_norm)
    model = Actor(make_model()) if actor else make_model()
    optimizer = strategy.create_optimizer(model, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    model, optimizer, scheduler = strategy.prepare((model, optimizer, scheduler))
    batches = iter(strategy.setup_dataloader(make_dataset(), MICRO, shuffle=False))
    after_each_step, mid_way = [], []
    for micro_step in range(1, STEPS * ACCUM + 1):
        x, y = next(batches)
        loss = F.mse_loss(model(x.to(torch.bfloat16 if bf16 else torch.float32)).float(), y)
        strategy.backward(loss, model, optimizer)
        strategy.optimizer_step(optimizer, model, scheduler)
        if micro_step % ACCUM == 0:
            after_each_step.append(strategy.get_grad_norm(model))
        else:  # mid-way through an accumulation, the first one before any optimizer step too
            mid_way.append(strategy.get_grad_norm(model))
    return after_each_step, mid_way


def loader_round_trips_on_two_ranks(*trip):
    return loader_round_trips(new_strategy(0), 20, *trip)


def loader_through_a_checkpoint(out_dir):
    """The batches after step 3 of a shuffled epoch of 16 micro-batches a rank, uninterrupted, and resumed by a
    fresh engine and loader from a checkpoint whose client_state holds the loader's state."""
    strategy = new_strategy(2)
    engine, optimizer, scheduler = prepared(strategy)
    loader = strategy.setup_dataloader(make_dataset(), MICRO)
    batches = iter(loader)
    train(strategy, engine, optimizer, scheduler, batches, 3)
    ckpt = os.path.join(out_dir, "loader_ckpt")
    strategy.save_ckpt(engine, ckpt, client_state={"loader": loader.state_dict()})
    uninterrupted = [x for x, _ in batches] + [x for x, _ in loader]
    engine, _, _ = prepared(strategy, init_seed=999)
    _, client_state = strategy.load_ckpt(engine, ckpt)
    restored = strategy.setup_dataloader(make_dataset(), MICRO)
    restored.load_state_dict(client_state["loader"])
    resumed = [x for x, _ in restored] + [x for x, _ in restored]
    return dict(uninterrupted=torch.stack(uninterrupted), resumed=torch.stack(resumed))


def loader_before_setup():
    """The unshuffled sample indices of a loader from a strategy that never called setup_distributed, in a
    process group that exists."""
    strategy = get_strategy(argparse.Namespace(zero_stage=0))
    loader = strategy.setup_dataloader(torch.utils.data.TensorDataset(torch.arange(20)), 2, shuffle=False)
    return [i for (batch,) in loader for i in batch.tolist()]


def load_model_verdict_at_zero_3(out_dir):
    """What load_model says on each rank at ZeRO 3 of a file with one bit flipped in a record that only rank 1's
    share of the CRC check reads."""
    strategy = new_strategy(3)
    engine = strategy.prepare(make_model())
    path = os.path.join(out_dir, "verdict.pt")
    if strategy.is_rank_0():
        torch.save(make_model().state_dict(), path)
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
        # The ranks share the records by index: record i is checked by rank i % world_size alone.
        flip_a_bit_in_the_largest_tensor(path, max(records[1::2], key=lambda info: info.file_size))
    dist.barrier()
    return error_of(strategy.load_model, engine, path)


def readme_usage(out_dir):
    """The README's usage block, run as written, with a model, a dataset and a loss function given to it (ZeRO
    2, 2 ranks: 32 samples a step, 4 accumulation steps of 4); returns its model's weights."""
    readme = open(os.path.join(HERE, "README.md")).read()
    snippet = re.search(r"## Using it in your trainer\n\n```python\n(.*?)```", readme, re.DOTALL).group(1)
    argv, sys.argv = sys.argv, ["train.py", "--zero_stage", "2"]
    namespace = dict(model=make_model(), dataset=make_dataset(), loss_fn=F.mse_loss)
    try:
        exec(compile(snippet, "README.md", "exec"), namespace)
    finally:
        sys.argv = argv
    return {name: p.detach().clone() for name, p in namespace["model"].module.named_parameters()}


def flags_and_data_cases(out_dir):
    cases = {}  # result key: what computes it
    for stage in range(4):
        for max_norm in (MAX_NORM, 0):
            cases[f"grad_norm_stage{stage}_max_norm{max_norm}"] = partial(grad_norms, stage, max_norm)
        cases[f"grad_norm_bf16_stage{stage}"] = partial(grad_norms, stage, bf16=True)
    cases["grad_norm_actor"] = partial(grad_norms, 0, actor=True)
    for trip in ROUND_TRIPS:
        cases["round_trips_{}_{}_{}".format(*trip)] = partial(loader_round_trips_on_two_ranks, *trip)
    cases["loader_through_a_checkpoint"] = partial(loader_through_a_checkpoint, out_dir)
    cases["loader_before_setup"] = loader_before_setup
    cases["load_model_verdict_zero3"] = partial(load_model_verdict_at_zero_3, out_dir)
    cases["readme_usage"] = partial(readme_usage, out_dir)  # last: it ends with teardown(), as the README does
    return cases


def run_crash(out_dir):
    strategy = new_strategy(2)
    rank = strategy.get_rank()
    engine, optimizer, scheduler = prepared(strategy)
    loader = strategy.setup_dataloader(make_dataset(), MICRO)
    batches = iter(loader)
    ckpt = os.path.join(out_dir, "ckpt")
    train(strategy, engine, optimizer, scheduler, batches, 2)
    strategy.save_ckpt(engine, ckpt, tag="last")
    if rank == 0:
        torch.save(full_params(engine), os.path.join(out_dir, "params_at_step2.pt"))
    train(strategy, engine, optimizer, scheduler, batches, 2)
    if rank == 1:  # rank 1 dies half-way through saving over "last": after its RNG file, before DeepSpeed's files
        engine.save_checkpoint = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    strategy.save_ckpt(engine, ckpt, tag="last")
    print("a save completed although rank 1 died", flush=True)


def run_rendezvous():
    messages = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        for world_size, port in (("1", taken.getsockname()[1]), ("2", free_port())):
            os.environ.update(
                RANK="0", LOCAL_RANK="0", WORLD_SIZE=world_size, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
            )
            try:
                get_strategy(argparse.Namespace(zero_stage=2, train_batch_size=2)).setup_distributed(
                    timedelta(seconds=3)
                )
                messages.append("joined")
            except RuntimeError as error:
                messages.append(str(error))
    print(json.dumps(messages))


def run_mismatch():
    args = argparse.Namespace(zero_stage=2, micro_train_batch_size=2, train_batch_size=6)
    try:
        get_strategy(args).setup_distributed(timeout=timedelta(minutes=5))
    finally:
        print(f"process group initialized: {torch.distributed.is_initialized()}", flush=True)


if __name__ == "__main__":
    # The workers the tests start, each with the folders it is given after --worker NAME.
    workers = dict(quick=run_quick, core=run_core, crash=run_crash, crash_record=run_crash_record)
    workers.update(reshape_save3=run_reshape_save3, reshape_resume3=run_reshape_resume3, loader_alone=run_loader_alone)
    workers.update(rendezvous=run_rendezvous, mismatch=run_mismatch)
    workers.update(background_exit=run_background_exit, background_killed=run_background_killed)
    workers.update(background_exit_failed=run_background_exit_failed, background_signals=run_background_signals)
    workers.update(save_alone=run_save_alone)
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=workers, required=True)
    parser.add_argument("folders", nargs="*")
    parser.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher
    cli = parser.parse_args()
    # DeepSpeed's op builder asks py-cpuinfo (a subprocess, a second) twice each time it builds a DeepSpeedCPUAdam,
    # and a launch builds dozens: once per process is enough.
    import cpuinfo

    cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)
    workers[cli.worker](*cli.folders)
    # The worker's results are written and its process group torn down. Leave without Python's shutdown, where a
    # gloo thread still releasing a collective can abort the process ("terminate called without an active
    # exception", seen once in a three-rank launch after teardown()); the tests judge the results.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)
