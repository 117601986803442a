"""Run OpenRLHF 0.8.5's own SFT, reward-model and DPO pipelines on get_strategy.py: 2 CPU ranks, ZeRO 2 and 3.

    bash compat/openrlhf/bootstrap.sh                 # once: compat/openrlhf/.venv
    compat/openrlhf/.venv/bin/python compat/openrlhf/run.py [--work DIR] [--only sft_2 ...]

OpenRLHF's code runs as installed, except its import lines: a copy of the package is written to the work
folder with exactly the lines README.md lists changed ("from openrlhf.utils import get_strategy" and the
sampler's import), and nothing else. Two stand-ins cover OpenRLHF's GPU-only assumptions, nothing the strategy
should provide: a `flash_attn` module (its models import it at top level; without --packing_samples nothing in
it is called) and `torch.cuda.current_device()` returning "cpu" (its trainers move batches with it).

For each pipeline and stage, on a tiny random Llama (tied embeddings) with a tokenizer built here:
  1. a full run of 2 epochs, saving a checkpoint after every optimizer step, then the final weights;
  2. a run started with --load_checkpoint from the checkpoint in the middle of the first epoch; its final
     weights must equal the full run's (the data order, random generators and optimizer state all resume);
  3. from_pretrained on the full run's saved folder, with no weight missing or unexpected.
It prints one table row per pipeline and stage, and exits non-zero if any check fails. Then, in another shape:
the SFT run's ZeRO 2 checkpoint from the middle of the first epoch resumed at ZeRO 3 (sft_2to3); its final
weights must lie as close to the ZeRO 2 run's as the uninterrupted ZeRO 3 run's do (float rounding: the two
stages sum gradients in another order).
"""

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# The import lines that change, file by file: every other line of OpenRLHF runs as released.
IMPORT_SWAPS = {
    f"cli/train_{name}.py": [
        (
            "from openrlhf.utils import get_strategy, get_tokenizer\n",
            "from get_strategy import get_strategy\nfrom openrlhf.utils import get_tokenizer\n",
        )
    ]
    for name in ("sft", "rm", "dpo")
}
IMPORT_SWAPS.update(
    {
        f"trainer/{name}_trainer.py": [
            (
                "from openrlhf.utils.distributed_sampler import DistributedSampler\n",
                "from get_strategy import DistributedSampler\n",
            )
        ]
        for name in ("sft", "rm", "dpo")
    }
)

# flash_attn: the names OpenRLHF imports, each failing loudly if it were ever called.
FLASH_ATTN_STUB = {
    "flash_attn/__init__.py": "",
    "flash_attn/bert_padding.py": "def _absent(*args, **kwargs):\n    raise RuntimeError('flash_attn is a stand-in here')\n\n"
    + "index_first_axis = pad_input = rearrange = unpad_input = _absent\n",
    "flash_attn/utils/__init__.py": "",
    "flash_attn/utils/distributed.py": "from flash_attn.bert_padding import _absent as all_gather\n",
    # Started in every process through PYTHONPATH: OpenRLHF's trainers call torch.cuda.current_device().
    "sitecustomize.py": "import torch\n\ntorch.cuda.current_device = lambda: 'cpu'\n",
}

STEPS_PER_EPOCH, EPOCHS, TRAIN_BATCH, MICRO = 6, 2, 8, 2  # 2 ranks x 2 micro-batches of 2 per step
RESUME_AT = 3  # a checkpoint in the middle of the first epoch


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def patched_openrlhf(work):
    """A copy of the installed openrlhf package with the import lines swapped; returns the folder holding it."""
    import openrlhf

    site = os.path.join(work, "site")
    shutil.rmtree(site, ignore_errors=True)
    shutil.copytree(os.path.dirname(openrlhf.__file__), os.path.join(site, "openrlhf"))
    for relative, swaps in IMPORT_SWAPS.items():
        path = os.path.join(site, "openrlhf", relative)
        text = open(path).read()
        for old, new in swaps:
            assert text.count(old) == 1, f"{relative}: expected the line {old!r} once"
            text = text.replace(old, new)
        write(path, text)
    for relative, text in FLASH_ATTN_STUB.items():
        write(os.path.join(site, relative), text)
    return site


def fixtures(work):
    """A tokenizer and a tiny random Llama in work/pretrain, and the three data sets as JSON lines."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    numbers = [" ".join(str((start + i) % 50) for i in range(8)) for start in range(STEPS_PER_EPOCH * TRAIN_BATCH)]
    sft = [{"input": f"count on from {n.split()[0]}", "output": n} for n in numbers]
    pairs = [
        {"prompt": f"count on from {n.split()[0]}: ", "chosen": n, "rejected": " ".join([n.split()[0]] * 8)}
        for n in numbers
    ]
    for name, rows in (("sft", sft), ("pairs", pairs)):
        write(os.path.join(work, f"{name}.jsonl"), "".join(json.dumps(row) + "\n" for row in rows))

    pretrain = os.path.join(work, "pretrain")
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    corpus = [row["input"] + " " + row["output"] for row in sft] + ["User: Assistant: count on from :"]
    tokenizer.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>", "<pad>"]))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(pretrain)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=256,
        intermediate_size=512,  # each MLP weight has 131,072 elements: above the 100,000 ZeRO 3 keeps whole
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(pretrain)
    return pretrain


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(pipeline, stage, work, site, pretrain, name, resume):
    """One torchrun of OpenRLHF's cli/train_<pipeline>.py; returns (seconds, rank 0's output)."""
    out = os.path.join(work, name)
    options = {
        "--pretrain": pretrain,
        "--dataset": os.path.join(work, "sft.jsonl" if pipeline == "sft" else "pairs.jsonl"),
        "--max_len": 48,
        "--zero_stage": stage,
        "--micro_train_batch_size": MICRO,
        "--train_batch_size": TRAIN_BATCH,
        "--max_epochs": EPOCHS,
        "--learning_rate": "5e-3",
        "--lr_warmup_ratio": 0,
        "--save_steps": 1,
        "--max_ckpt_num": 100,
        "--ckpt_path": os.path.join(out, "ckpt"),
        "--save_path": os.path.join(out, "final"),
        "--logging_steps": 1,
        "--seed": 42,
    }
    flags = [str(item) for option in options.items() for item in option]  # each flag followed by its value
    # The reward model evaluates once an epoch: without --eval_dataset it takes 1% of 48 samples, none. At the
    # others' learning rate its loss stays near log 2 for these 12 steps, so it gets a larger one.
    flags += {
        "sft": ["--output_key", "output"],
        "rm": [
            "--prompt_key",
            "prompt",
            "--eval_dataset",
            os.path.join(work, "pairs.jsonl"),
            "--learning_rate",
            "1e-2",
        ],
        "dpo": ["--prompt_key", "prompt"],
    }[pipeline]
    if resume:
        flags.append("--load_checkpoint")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join([site, REPO]), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    port = str(free_port())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    cmd = [*torchrun, "-m", f"openrlhf.cli.train_{pipeline}", *flags]
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=work)
    with open(os.path.join(work, f"{name}.log"), "w") as f:
        f.write(done.stdout)
    if done.returncode != 0:
        raise RuntimeError(
            f"{name} exited {done.returncode}; its output is in {work}/{name}.log:\n{done.stdout[-3000:]}"
        )
    return time.perf_counter() - started, done.stdout


def micro_step_losses(output):
    """The loss of each micro-step, averaged over ranks, from rank 0's progress bar: SFT shows gpt_loss, the
    reward model and DPO show loss. The bar redraws a postfix until the next one, so repeats are dropped."""
    postfixes = re.findall(r"it/s, ([^\]]*)\]", output)
    unique = [p for i, p in enumerate(postfixes) if i == 0 or p != postfixes[i - 1]]
    return [float(m.group(1)) for p in unique if (m := re.search(r"(?:^|, )(?:gpt_)?loss=([-\d.e]+)", p))]


def saved_weights(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def max_abs_diff(weights, other):
    """The largest absolute difference between two state dicts' weights, over every key of the first."""
    return max((weights[k].float() - other[k].float()).abs().max().item() for k in weights)


def resume(pipeline, stage, work, site, pretrain, source, name):
    """Run `name`: started with --load_checkpoint from a copy of run `source`'s checkpoints whose 'latest' names
    the middle of the first epoch (step RESUME_AT). Returns its final weights."""
    resumed = os.path.join(work, name)
    shutil.rmtree(resumed, ignore_errors=True)
    shutil.copytree(os.path.join(work, source, "ckpt"), os.path.join(resumed, "ckpt"))
    write(os.path.join(resumed, "ckpt", "latest"), f"global_step{RESUME_AT}")
    _, output = launch(pipeline, stage, work, site, pretrain, name, resume=True)
    assert f"consumed_samples: {RESUME_AT * TRAIN_BATCH}" in output, "the resumed run did not load"
    return saved_weights(os.path.join(resumed, "final"))


def check(pipeline, stage, work, site, pretrain):
    import torch
    from transformers import AutoModelForCausalLM

    name = f"{pipeline}_{stage}"
    seconds, output = launch(pipeline, stage, work, site, pretrain, name, resume=False)
    losses = micro_step_losses(output)
    steps = len([n for n in os.listdir(os.path.join(work, name, "ckpt")) if re.fullmatch(r"global_step\d+", n)])
    again = resume(pipeline, stage, work, site, pretrain, source=name, name=f"{name}_resumed")
    full = saved_weights(os.path.join(work, name, "final"))
    assert full.keys() == again.keys()
    resume_diff = max_abs_diff(full, again)

    folder = os.path.join(work, name, "final")
    if pipeline == "rm":
        from openrlhf.models import get_llm_for_sequence_regression

        loaded = get_llm_for_sequence_regression(folder, "reward", init_value_head=False, bf16=False)
        problems = {}
    else:
        loaded, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        problems = {k: v for k, v in info.items() if v}
    reloaded_equal = all(torch.equal(loaded.state_dict()[k], v) for k, v in full.items() if k in loaded.state_dict())
    return dict(
        pipeline=pipeline,
        stage=stage,
        steps=steps,
        first=sum(losses[:4]) / 4,  # the first two optimizer steps
        last=sum(losses[-4:]) / 4,  # the last two
        resume_diff=resume_diff,
        loads=not problems and reloaded_equal,
        problems=problems,
        seconds=seconds,
    )


def check_reshape(work, site, pretrain):
    """sft_2's checkpoint at RESUME_AT resumed at ZeRO 3: (its distance to sft_2's weights, sft_3's)."""
    resumed = resume("sft", 3, work, site, pretrain, source="sft_2", name="sft_2to3_resumed")
    zero2 = saved_weights(os.path.join(work, "sft_2", "final"))
    return max_abs_diff(zero2, resumed), max_abs_diff(zero2, saved_weights(os.path.join(work, "sft_3", "final")))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/openrlhf-compat", help="scratch folder, emptied first")
    parser.add_argument(
        "--only",
        nargs="*",
        help="runs to do, such as sft_2 rm_3 (default: all six, and sft_2to3, which needs sft_2 and sft_3); "
        "ppo: only PPO under Ray, all its rows (ppo.py)",
    )
    args = parser.parse_args()
    if args.only == ["ppo"]:
        import ppo

        sys.exit(ppo.main([]))
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    site = patched_openrlhf(args.work)
    sys.path[:0] = [site, REPO]
    pretrain = fixtures(args.work)
    runs = [(p, s) for p in ("sft", "rm", "dpo") for s in (2, 3) if not args.only or f"{p}_{s}" in args.only]
    print(
        "| pipeline | ZeRO | optimizer steps | loss, first 2 steps | loss, last 2 steps | resumed vs full run, max abs weight diff | from_pretrained | seconds (full run) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    failed = False
    for pipeline, stage in runs:
        try:
            r = check(pipeline, stage, args.work, site, pretrain)
        except Exception as error:  # report and go on, so one failure does not hide the others
            print(f"| {pipeline} | {stage} | FAILED: {str(error).splitlines()[0]} | | | | | |", flush=True)
            failed = True
            continue
        ok = r["steps"] == STEPS_PER_EPOCH * EPOCHS and r["last"] < r["first"] and r["resume_diff"] == 0 and r["loads"]
        failed |= not ok
        print(
            f"| {pipeline} | {stage} | {r['steps']} | {r['first']:.4f} | {r['last']:.4f} | {r['resume_diff']:.1e} | "
            f"{'loads' if r['loads'] else r['problems']} | {r['seconds']:.0f} |" + ("" if ok else " <- FAILED"),
            flush=True,
        )
    if not args.only or "sft_2to3" in args.only:
        try:
            resumed, uninterrupted = check_reshape(args.work, site, pretrain)
            ok = resumed <= max(uninterrupted, 1e-6) * 2
            print(
                f"\nsft, ZeRO 2 checkpoint at step {RESUME_AT} resumed at ZeRO 3: final weights {resumed:.1e} from the "
                f"ZeRO 2 run's (the uninterrupted ZeRO 3 run: {uninterrupted:.1e})" + ("" if ok else " <- FAILED")
            )
            failed |= not ok
        except Exception as error:
            print(f"sft_2to3 FAILED: {str(error).splitlines()[0]}")
            failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
