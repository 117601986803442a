"""Break each core behaviour of get_strategy.py by hand, one at a time, and name the quick-tier test that fails.

    python3 .ci/mutants.py                     # every mutant: about 5 minutes on 2 cores
    python3 .ci/mutants.py --only clipping_off mean_made_a_sum

Each mutant is one replacement in a copy of the repository's files (in --work, reused so that DeepSpeed's ops
compile once); the quick tier (`python -m pytest -q -x test_get_strategy.py`) then runs on the copy and stops at the
first failing test, which is printed. A mutant that no quick test catches is printed as SURVIVED: a hole in the
quick tier. Not part of CI, which would run the quick tier once per mutant.

On 2026-12-03 (release 0.19.0's get_strategy.py, this stop's test file, 2 cores with AVX2) every mutant was caught
(the unmutated quick tier: 46 s). "set-up" means the failure came in the set-up of the quick tier's shared one-rank
fixture (`one_rank_loads`), which pytest reports at its first test:

    clipping_off, accumulation_dropped     test_train_config_for_each_stage[0]
    every_parameter_decays                 test_create_optimizer_decays_matrices_but_not_biases_or_norm_weights
    scheduler_not_stepped                  set-up (one_rank_loads)
    mean_made_a_sum                        test_all_reduce_and_all_gather_return_what_hand_computation_gives
    torch_generator_not_restored           test_load_ckpt_in_another_shape_restores_the_weights_adam_the_sch...
    sampler_skip_ignored                   test_without_a_process_group_a_loader_restored_from_any_state_yie...
    loader_batches_miscounted              (the same)
    failed_write_not_shared                test_a_write_that_fails_on_any_rank_raises_on_every_rank_at_once_...
    crc_not_compared                       test_load_model_refuses_a_file_with_a_flipped_bit_naming_it
    adam_moments_dropped_in_another_shape  set-up (one_rank_loads)
    bad_zero_stage_accepted                test_invalid_value_raises_value_error_naming_its_flag[kwargs0---zero_stage]

failed_write_not_shared takes about 150 s, near the 2-minute timeout the tests' process groups have: after the failed
write one rank waits in a collective the other never joins. The quick launch's other cases keep their results, and
the failing-save tests fail on their own.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = [
    "get_strategy.py",
    "test_get_strategy.py",
    "train_example.py",
    "pyproject.toml",
    "requirements.txt",
    "README.md",
]

# name: (the behaviour it breaks, the text in get_strategy.py, what replaces it)
MUTANTS = {
    "clipping_off": (
        "gradients are clipped to max_norm",
        'config["gradient_clipping"] = self.max_norm',
        'config["gradient_clipping"] = 0.0',
    ),
    "accumulation_dropped": (
        "a step accumulates train_batch_size samples",
        '"train_batch_size": self.train_batch_size,',
        '"train_batch_size": self.micro_train_batch_size * (self.world_size or 1),',
    ),
    "every_parameter_decays": (
        "biases and norm weights take no weight decay",
        'no_decay = [p for p in params if len(getattr(p, "ds_shape", p.shape)) < 2]',
        "decay, no_decay = params, []",
    ),
    "scheduler_not_stepped": (
        "DeepSpeed steps the scheduler",
        "model=engine_of(model), optimizer=optimizer, lr_scheduler=scheduler, config=self.get_ds_train_config()",
        "model=engine_of(model), optimizer=optimizer, lr_scheduler=None, config=self.get_ds_train_config()",
    ),
    "mean_made_a_sum": (
        "all_reduce's mean divides by the world size",
        "tensor = (tensor.double() if exact else tensor) / self.world_size",
        "tensor = tensor.double() if exact else tensor",
    ),
    "torch_generator_not_restored": (
        "a resume restores torch's generator",
        '        torch.set_rng_state(states["torch"])\n',
        "",
    ),
    "sampler_skip_ignored": (
        "the sampler skips consumed samples",
        "return iter(list(super().__iter__())[self.skip :])",
        "return iter(list(super().__iter__()))",
    ),
    "loader_batches_miscounted": (
        "the loader's state counts the batches handed out",
        "seen = sampler.skip + self.yielded * self.batch_size",
        "seen = sampler.skip + (self.yielded + 1) * self.batch_size",
    ),
    "failed_write_not_shared": (
        "a failed write on one rank stops the commit on every rank",
        "problem = next((failed for failed, _, _ in every_rank if failed), None)",
        "problem = every_rank[self.rank][0]",
    ),
    "crc_not_compared": (
        "a damaged file is named at load",
        "while record.read(1 << 24):",
        "while False:",
    ),
    "adam_moments_dropped_in_another_shape": (
        "a resume in another shape carries Adam's moments",
        "values = read_elements(self.pieces.get((name, key), []), start, length, required=False)",
        "values = torch.zeros(length)",
    ),
    "snapshot_not_copied": (
        "a background save writes the state at its call, not what training made of it since",
        "buffer.untyped_storage().copy_(storage, non_blocking=True)",
        "pass  # the buffer keeps what it held",
    ),
    "rank_0s_model_states_for_all": (
        "at ZeRO 3 each rank resumes its own buffers and client_state",
        'own = rank if rank < self.done["world_size"] else 0',
        "own = 0",
    ),
    "pending_cleared_before_the_wait": (
        "a wait for a background save that a signal interrupts leaves the save in flight",
        "        pending.done.wait()\n        strategy.pending_save = None\n",
        "        strategy.pending_save = None\n        pending.done.wait()\n",
    ),
    "order_by_file_time": (
        "checkpoints go in the order their records were committed, not by their files' times",
        "return sequence, os.path.getmtime(os.path.join(folder, DONE_FILE)), tag",
        "return 0, os.path.getmtime(os.path.join(folder, DONE_FILE)), tag",
    ),
    "buffers_never_shrink": (
        "a background save's buffers are as large as its own files' storages",
        "writer.buffers = files.copies",
        "writer.buffers = files.copies + writer.buffers[len(files.copies) :]",
    ),
    "bad_zero_stage_accepted": (
        "a bad flag is refused before any process group",
        "if not (_is_int(zero_stage) and 0 <= zero_stage <= 3):",
        "if not _is_int(zero_stage):",
    ),
}


def run_quick_tier(work: str) -> tuple:
    """(seconds, the first failing test or None) of the quick tier in work."""
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "test_get_strategy.py"]
    done = subprocess.run(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    failed = re.search(r"FAILED test_get_strategy\.py::(\S+)", done.stdout) or re.search(
        r"ERROR (?:at \w+ of )?(\S+)", done.stdout
    )
    if done.returncode not in (0, 1):
        failed = failed or re.search(r"(.*)$", done.stdout.strip())
    return time.perf_counter() - started, failed.group(1) if failed else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/get_strategy_mutants", help="the copy the quick tier runs in")
    parser.add_argument("--only", nargs="+", choices=list(MUTANTS), help="these mutants (default: all)")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    for name in FILES:
        shutil.copy(os.path.join(ROOT, name), args.work)
    source = open(os.path.join(ROOT, "get_strategy.py")).read()
    seconds, failed = run_quick_tier(args.work)
    print(f"unmutated: {'passes' if failed is None else 'FAILS at ' + failed} ({seconds:.0f} s)", flush=True)
    if failed is not None:
        sys.exit(1)
    print("| mutant | breaks | first failing quick-tier test | seconds |\n| --- | --- | --- | --- |")
    for name in args.only or MUTANTS:
        behaviour, text, replacement = MUTANTS[name]
        if source.count(text) != 1:
            sys.exit(f"{name}: {text!r} occurs {source.count(text)} times in get_strategy.py, not once")
        with open(os.path.join(args.work, "get_strategy.py"), "w") as f:
            f.write(source.replace(text, replacement))
        seconds, failed = run_quick_tier(args.work)
        print(f"| {name} | {behaviour} | {failed or 'SURVIVED'} | {seconds:.0f} |", flush=True)
    shutil.copy(os.path.join(ROOT, "get_strategy.py"), args.work)


if __name__ == "__main__":
    main()
