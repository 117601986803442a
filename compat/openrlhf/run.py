"""Run OpenRLHF's own trainers on get_strategy.py, 2 CPU ranks at ZeRO 2 and 3: every trainer of 0.8.5 that calls
get_strategy (SFT, reward model, DPO, KD, KTO, PRM, batch_inference), and SFT, reward model and DPO of 0.10.1, the
last release with flat flags.

    bash compat/openrlhf/bootstrap.sh                 # once: compat/openrlhf/.venv, OpenRLHF 0.8.5
    bash compat/openrlhf/bootstrap.sh 0.10.1          # once: compat/openrlhf/.venv-0.10.1, OpenRLHF 0.10.1
    python3 compat/openrlhf/run.py [--release 0.10.1] [--only sft_2 kd_3 ...] [--python 0.8.5=PATH] [--work DIR]

Each release runs in its own venv (a child process of this script, started with that venv's Python). OpenRLHF's
code runs as installed, except its import lines: a copy of the package is written to the work folder with exactly
the lines README.md lists changed ("from openrlhf.utils import get_strategy, ..." and the sampler's import), and
nothing else. Two stand-ins cover OpenRLHF's GPU-only assumptions, nothing the strategy should provide: a
`flash_attn` module (its models import it at top level; without --packing_samples nothing in it is called) and
`torch.cuda.current_device()` returning "cpu" (0.8.5's trainers move batches with it).

For each training pipeline and stage, on a tiny random Llama (tied embeddings) with a tokenizer built here:
  1. a full run of 2 epochs, saving a checkpoint after every optimizer step, then the final weights;
  2. a run started with --load_checkpoint from the checkpoint in the middle of the first epoch; its final
     weights must equal the full run's (the data order, random generators and optimizer state all resume);
  3. from_pretrained on the full run's saved folder, with no weight missing or unexpected.
0.10.1's rows also need a finite grad_norm (strategy.get_grad_norm) in every line of their logs, non-zero after
the first micro-step (0.0 there, before any optimizer step, as OpenRLHF's own strategy returns).
batch_inference's generate rows must write, for every prompt, what plain transformers' greedy generate writes.
It prints one table row per run, and exits non-zero if any check fails. Then, in another shape: 0.8.5's SFT run's
ZeRO 2 checkpoint from the middle of the first epoch resumed at ZeRO 3 (sft_2to3); its final weights must lie as
close to the ZeRO 2 run's as the uninterrupted ZeRO 3 run's do (float rounding: the two stages sum gradients in
another order).
"""

import argparse
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# Each release's venv (bootstrap.sh makes it) and the training pipelines it runs, by the name of its cli module.
VENVS = {"0.8.5": ".venv", "0.10.1": ".venv-0.10.1"}
TRAINERS = {"0.8.5": ("sft", "rm", "dpo", "kd", "kto", "prm"), "0.10.1": ("sft", "rm", "dpo")}
INFERENCE = ("generate", "rm")  # 0.8.5's batch_inference: its two --eval_task modes that run without vLLM


def import_swaps(release):
    """The import lines that change, file by file: every other line of OpenRLHF runs as released."""
    strategy_line = "from openrlhf.utils import get_strategy, get_tokenizer\n"
    ours = "from get_strategy import get_strategy\nfrom openrlhf.utils import get_tokenizer\n"
    sampler_line = "from openrlhf.utils.distributed_sampler import DistributedSampler\n"
    swaps = {f"cli/train_{name}.py": [(strategy_line, ours)] for name in TRAINERS[release]}
    for name in TRAINERS[release]:
        swaps[f"trainer/{name}_trainer.py"] = [(sampler_line, "from get_strategy import DistributedSampler\n")]
    if release == "0.8.5":
        swaps["cli/batch_inference.py"] = [
            (
                "from openrlhf.utils import get_processor, get_strategy, get_tokenizer\n",
                "from get_strategy import get_strategy\nfrom openrlhf.utils import get_processor, get_tokenizer\n",
            )
        ]
    return swaps


# flash_attn: the names OpenRLHF imports, each failing loudly if it were ever called.
FLASH_ATTN_STUB = {
    "flash_attn/__init__.py": "",
    "flash_attn/bert_padding.py": "def _absent(*args, **kwargs):\n    raise RuntimeError('flash_attn is a stand-in here')\n\n"
    + "index_first_axis = pad_input = rearrange = unpad_input = _absent\n",
    "flash_attn/utils/__init__.py": "",
    "flash_attn/utils/distributed.py": "from flash_attn.bert_padding import _absent as all_gather\n",
    # Its metadata under another name, so transformers 5 sees a module that is not flash-attn (without any,
    # 5.5.3's is_flash_attn_2_available() raises KeyError: 'flash_attn').
    "flash_attn_stand_in-0.dist-info/METADATA": "Metadata-Version: 2.1\nName: flash-attn-stand-in\nVersion: 0\n",
    "flash_attn_stand_in-0.dist-info/top_level.txt": "flash_attn\n",
    # Started in every process through PYTHONPATH: OpenRLHF 0.8.5's trainers call torch.cuda.current_device().
    "sitecustomize.py": "import torch\n\ntorch.cuda.current_device = lambda: 'cpu'\n",
}

STEPS_PER_EPOCH, EPOCHS, TRAIN_BATCH = 6, 2, 8
# 2 ranks x 2 micro-batches of 2 per step, in both releases: gradients accumulate over 2 micro-steps.
MICRO = {"0.8.5": 2, "0.10.1": 2}
RESUME_AT = 3  # a checkpoint in the middle of the first epoch
PLACEHOLDER, GOOD, BAD = "ки", "+", "-"  # the process reward model's step mark and its two labels, as OpenRLHF's docs


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def patched_openrlhf(work, release):
    """A copy of the installed openrlhf package with the import lines swapped; returns the folder holding it."""
    import openrlhf

    site = os.path.join(work, "site")
    shutil.rmtree(site, ignore_errors=True)
    shutil.copytree(os.path.dirname(openrlhf.__file__), os.path.join(site, "openrlhf"))
    for relative, swaps in import_swaps(release).items():
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
    """A tokenizer and a tiny random Llama in work/pretrain, the same with the process reward model's three
    tokens added in work/pretrain_prm, a reward model on the first in work/reward, and the data sets as JSON lines."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    numbers = [" ".join(str((start + i) % 50) for i in range(8)) for start in range(STEPS_PER_EPOCH * TRAIN_BATCH)]
    sft = [{"input": f"count on from {n.split()[0]}", "output": n} for n in numbers]
    pairs = [
        {"prompt": f"count on from {n.split()[0]}: ", "chosen": n, "rejected": " ".join([n.split()[0]] * 8)}
        for n in numbers
    ]
    # KTO: one answer per prompt, every other one wrong and labelled so.
    kto = [
        {"input": p["prompt"], "output": p["chosen"] if i % 2 == 0 else p["rejected"], "label": i % 2 == 0}
        for i, p in enumerate(pairs)
    ]
    # PRM: four steps of two numbers, each followed by the placeholder; a step that repeats a number is wrong.
    prm = []
    for i, n in enumerate(numbers):
        words = n.split()
        steps = [words[j : j + 2] if (i + j) % 3 else [words[j]] * 2 for j in range(0, 8, 2)]
        text = f"count on from {words[0]} " + " ".join(" ".join(step) + f" {PLACEHOLDER}" for step in steps)
        prm.append({"input": text, "label": [GOOD if step[0] != step[1] else BAD for step in steps]})
    for name, rows in (("sft", sft), ("pairs", pairs), ("kto", kto), ("prm", prm)):
        write(os.path.join(work, f"{name}.jsonl"), "".join(json.dumps(row) + "\n" for row in rows))

    pretrain = os.path.join(work, "pretrain")
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    corpus = [row["input"] + " " + row["output"] for row in sft] + ["User: Assistant: count on from :"]
    tokenizer.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>", "<pad>"]))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_input_names=["input_ids", "attention_mask"],  # no token_type_ids, which Llama's generate() refuses
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
    model = LlamaForCausalLM(config)
    model.save_pretrained(pretrain)
    # The process reward model's tokens are added to a copy, so that the other runs keep their vocabulary.
    fast.add_tokens([PLACEHOLDER, GOOD, BAD])
    model.resize_token_embeddings(len(fast))
    model.save_pretrained(os.path.join(work, "pretrain_prm"))
    fast.save_pretrained(os.path.join(work, "pretrain_prm"))
    return pretrain


def reward_fixture(work, pretrain):
    """A reward model (the tiny Llama with a seeded value head) for batch_inference's rm mode, in work/reward."""
    import torch
    from openrlhf.models import get_llm_for_sequence_regression
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    reward = get_llm_for_sequence_regression(pretrain, "reward", init_value_head=True, bf16=False)
    reward.save_pretrained(os.path.join(work, "reward"))
    AutoTokenizer.from_pretrained(pretrain).save_pretrained(os.path.join(work, "reward"))
    return os.path.join(work, "reward")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(module, flags, work, site, name):
    """One torchrun of OpenRLHF's `module` on 2 ranks; returns (seconds, rank 0's output), raising if it fails."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join([site, REPO]), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    port = str(free_port())
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    command += ["-m", module, *[str(flag) for flag in flags]]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=work)
    with open(os.path.join(work, f"{name}.log"), "w") as f:
        f.write(done.stdout)
    if done.returncode != 0:
        raise RuntimeError(
            f"{name} exited {done.returncode}; its output is in {work}/{name}.log:\n{done.stdout[-3000:]}"
        )
    return time.perf_counter() - started, done.stdout


def launch(release, pipeline, stage, work, site, name, resume):
    """One run of OpenRLHF's cli/train_<pipeline>.py; returns (seconds, rank 0's output)."""
    out = os.path.join(work, name)
    dataset = {"sft": "sft", "kd": "sft", "kto": "kto", "prm": "prm"}.get(pipeline, "pairs")
    options = {
        "--pretrain": os.path.join(work, "pretrain_prm" if pipeline == "prm" else "pretrain"),
        "--dataset": os.path.join(work, f"{dataset}.jsonl"),
        "--max_len": 48,
        "--zero_stage": stage,
        "--micro_train_batch_size": MICRO[release],
        "--train_batch_size": TRAIN_BATCH,
        "--max_epochs": EPOCHS,
        "--learning_rate": "5e-3",
        "--lr_warmup_ratio": 0,
        "--save_steps": 1 if pipeline != "kto" else -1,  # -1: none (0.8.5's KTOTrainer cannot save one, README)
        "--max_ckpt_num": 100,
        "--ckpt_path": os.path.join(out, "ckpt"),
        "--save_path": os.path.join(out, "final"),
        "--logging_steps": 1,
        "--seed": 42,
    }
    flags = [item for option in options.items() for item in option]  # each flag followed by its value
    # The reward model evaluates once an epoch: without --eval_dataset it takes 1% of 48 samples, none. At the
    # others' learning rate its loss stays near log 2 for these 12 steps, so it gets a larger one. KD runs
    # without an eval set: its evaluate() cannot read SFT batches (README).
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
        "kd": ["--output_key", "output", "--teacher_model", os.path.join(work, "pretrain")],
        "kto": ["--output_key", "output"],
        "prm": ["--placeholder_token", PLACEHOLDER, "--reward_tokens", GOOD, BAD],
    }[pipeline]
    if release == "0.10.1":
        flags += ["--attn_implementation", "eager"]  # its default, flash_attention_2, needs a GPU
    if resume:
        flags.append("--load_checkpoint")
    return torchrun(f"openrlhf.cli.train_{pipeline}", flags, work, site, name)


def postfixes(output):
    """rank 0's training-bar postfixes, one a micro-step: the bar redraws a postfix until the next one (also after
    an evaluation's bar, whose postfixes start with eval and are left out)."""
    found = [p for p in re.findall(r"it/s, ([^\]]*)\]", output) if not p.startswith("eval")]
    return [p for i, p in enumerate(found) if i == 0 or p != found[i - 1]]


def logged(output, key):
    """The values of `key` in the postfixes, averaged over ranks: SFT and KD log gpt_loss, KTO kto_loss, PRM
    prm_loss, the reward model and DPO loss; 0.10.1 also grad_norm."""
    values = [re.search(rf"(?:^|, ){key}=([^,]+)", p) for p in postfixes(output)]
    return [float(m.group(1)) for m in values if m]


def saved_weights(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def max_abs_diff(weights, other):
    """The largest absolute difference between two state dicts' weights, over every key of the first."""
    return max((weights[k].float() - other[k].float()).abs().max().item() for k in weights)


def resume(release, pipeline, stage, work, site, source, name):
    """Run `name`: started with --load_checkpoint from a copy of run `source`'s checkpoints whose 'latest' names
    the middle of the first epoch (step RESUME_AT). Returns its final weights."""
    resumed = os.path.join(work, name)
    shutil.rmtree(resumed, ignore_errors=True)
    shutil.copytree(os.path.join(work, source, "ckpt"), os.path.join(resumed, "ckpt"))
    write(os.path.join(resumed, "ckpt", "latest"), f"global_step{RESUME_AT}")
    _, output = launch(release, pipeline, stage, work, site, name, resume=True)
    assert f"consumed_samples: {RESUME_AT * TRAIN_BATCH}" in output, "the resumed run did not load"
    return saved_weights(os.path.join(resumed, "final"))


def reload(release, pipeline, folder):
    """from_pretrained on a saved folder (for the reward model, OpenRLHF's get_llm_for_sequence_regression, which
    calls it): (the model's state dict, what was missing or unexpected)."""
    if pipeline == "rm":
        from openrlhf.models import get_llm_for_sequence_regression

        dtype = {"bf16": False} if release == "0.8.5" else {"param_dtype": "bf16", "attn_implementation": "eager"}
        loaded = get_llm_for_sequence_regression(folder, "reward", init_value_head=False, **dtype)
        return loaded.state_dict(), {}
    from transformers import AutoModelForCausalLM

    loaded, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    return loaded.state_dict(), {k: v for k, v in info.items() if v}


def check(release, pipeline, stage, work, site):
    import torch

    name = f"{pipeline}_{stage}"
    seconds, output = launch(release, pipeline, stage, work, site, name, resume=False)
    loss_key = {"sft": "gpt_loss", "kd": "gpt_loss", "kto": "kto_loss", "prm": "prm_loss"}.get(pipeline, "loss")
    losses, grad_norms = logged(output, loss_key), logged(output, "grad_norm")
    per_step = TRAIN_BATCH // (2 * MICRO[release])  # micro-steps an optimizer step
    full = saved_weights(os.path.join(work, name, "final"))
    if pipeline == "kto":  # no checkpoint: the steps are counted from its log, and nothing resumes
        steps, resume_diff = len(losses) // per_step, None
    else:
        steps = len([n for n in os.listdir(os.path.join(work, name, "ckpt")) if re.fullmatch(r"global_step\d+", n)])
        again = resume(release, pipeline, stage, work, site, source=name, name=f"{name}_resumed")
        assert full.keys() == again.keys()
        resume_diff = max_abs_diff(full, again)
    state, problems = reload(release, pipeline, os.path.join(work, name, "final"))
    reloaded_equal = all(torch.equal(state[k].float(), v.float()) for k, v in full.items() if k in state)
    return dict(
        steps=steps,
        first=sum(losses[: 2 * per_step]) / (2 * per_step),  # the first two optimizer steps
        last=sum(losses[-2 * per_step :]) / (2 * per_step),  # the last two
        grad_norms=grad_norms,
        resume_diff=resume_diff,
        loads=not problems and reloaded_equal,
        problems=problems,
        seconds=seconds,
    )


def check_reshape(work, site):
    """sft_2's checkpoint at RESUME_AT resumed at ZeRO 3: (its distance to sft_2's weights, sft_3's)."""
    resumed = resume("0.8.5", "sft", 3, work, site, source="sft_2", name="sft_2to3_resumed")
    zero2 = saved_weights(os.path.join(work, "sft_2", "final"))
    return max_abs_diff(zero2, resumed), max_abs_diff(zero2, saved_weights(os.path.join(work, "sft_3", "final")))


def check_inference(task, stage, work, site, reward):
    """One run of batch_inference --eval_task <task>; for generate, its outputs against plain transformers' greedy
    generate on one process, prompt by prompt."""
    name = f"infer_{task}_{stage}"
    output_path = os.path.join(work, name, "out.jsonl")
    os.makedirs(os.path.dirname(output_path), exist_ok=True)
    flags = ["--eval_task", task, "--zero_stage", stage, "--dataset", os.path.join(work, "sft.jsonl")]
    flags += ["--output_path", output_path, "--max_len", 48, "--output_key", "output"]
    if task == "generate":
        # One prompt a batch, so that no padding makes the reference differ in the last bit.
        flags += ["--pretrain", os.path.join(work, "pretrain"), "--micro_batch_size", 1, "--greedy_sampling"]
        flags += ["--max_new_tokens", 8, "--prompt_max_len", 32]
    else:
        flags += ["--pretrain", reward, "--micro_batch_size", 2]
    try:
        seconds, _ = torchrun("openrlhf.cli.batch_inference", flags, work, site, name)
    except RuntimeError:
        # The rm mode reads 4 items from SFTDataset's batches of 3: OpenRLHF 0.8.5's own bug (README).
        log = open(os.path.join(work, f"{name}.log")).read()
        upstream = "for _, input_ids, attention_masks, info in pbar:" in log and "(expected 4, got 3)" in log
        if task == "rm" and upstream:
            return dict(written=None, equal=None, seconds=None, upstream="cli/batch_inference.py:248")
        raise
    with open(output_path) as f:
        written = [json.loads(line) for line in f]
    if task != "generate":
        return dict(written=len(written), equal=None, seconds=seconds, upstream=None)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(work, "pretrain"))
    model = AutoModelForCausalLM.from_pretrained(os.path.join(work, "pretrain"), attn_implementation="eager").eval()
    equal = 0
    for row in written:
        inputs = tokenizer(row["input"], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        equal += tokenizer.decode(ids[0], skip_special_tokens=True)[len(row["input"]) :] == row["output"]
    return dict(written=len(written), equal=equal, seconds=seconds, upstream=None)


def names(release):
    """Every run of a release, as --only names it."""
    runs = [f"{pipeline}_{stage}" for pipeline in TRAINERS[release] for stage in (2, 3)]
    if release == "0.8.5":
        runs += [f"infer_{task}_{stage}" for task in INFERENCE for stage in (0, 2, 3)] + ["sft_2to3"]
    return runs


def run_release(release, selected, work):
    """In the release's venv: do the selected runs, printing each result as a line 'ROW <json>'."""
    from importlib.metadata import version

    assert version("openrlhf") == release, f"this venv holds OpenRLHF {version('openrlhf')}, not {release}"
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    site = patched_openrlhf(work, release)
    sys.path[:0] = [site, REPO]
    pretrain = fixtures(work)
    reward = reward_fixture(work, pretrain) if any(n.startswith("infer_rm") for n in selected) else None
    for name in selected:
        kind, stage = name.rsplit("_", 1)
        row = dict(release=release, name=name)
        try:
            if name == "sft_2to3":
                row.update(zip(("resumed", "uninterrupted"), check_reshape(work, site)))
            elif kind.startswith("infer_"):
                row.update(check_inference(kind[len("infer_") :], int(stage), work, site, reward))
            else:
                row.update(check(release, kind, int(stage), work, site))
        except Exception as error:  # report and go on, so one failure does not hide the others
            row["error"] = str(error).splitlines()[0]
        print("ROW " + json.dumps(row), flush=True)


def passed(row):
    """Whether a row's checks hold; 'upstream' rows stop at OpenRLHF's own bug, named in the table."""
    if "error" in row:
        return False
    if row["name"] == "sft_2to3":
        return row["resumed"] <= max(row["uninterrupted"], 1e-6) * 2
    if row["name"].startswith("infer_"):
        return row["upstream"] is not None or row["equal"] in (None, row["written"]) and row["written"] == 48
    # 0.10.1 logs grad_norm at every micro-step: 0.0 before the first optimizer step, as OpenRLHF's strategy gives.
    norms = row["grad_norms"]
    norms_ok = all(math.isfinite(n) and n >= 0 for n in norms) and all(n > 0 for n in norms[1:])
    if row["release"] == "0.10.1":  # it logs grad_norm at every micro-step
        micro_steps = STEPS_PER_EPOCH * EPOCHS * TRAIN_BATCH // (2 * MICRO["0.10.1"])
        norms_ok = norms_ok and len(row["grad_norms"]) == micro_steps
    steps_ok = row["steps"] == STEPS_PER_EPOCH * EPOCHS
    resumed_ok = row["resume_diff"] == 0 or row["resume_diff"] is None and row["name"].startswith("kto_")
    return steps_ok and row["last"] < row["first"] and resumed_ok and row["loads"] and norms_ok


def print_tables(rows):
    mark = {True: "", False: " <- FAILED"}
    train = [r for r in rows if not r["name"].startswith("infer_") and r["name"] != "sft_2to3"]
    if train:
        print(
            "\n| release | pipeline | ZeRO | optimizer steps | loss, first 2 steps | loss, last 2 steps | grad_norm, "
            "min to max | resumed vs full run, max abs weight diff | from_pretrained | seconds (full run) |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in train:
        pipeline, stage = r["name"].rsplit("_", 1)
        if "error" in r:
            print(f"| {r['release']} | {pipeline} | {stage} | FAILED: {r['error']} | | | | | | |")
            continue
        resumed = "no checkpoint (README)" if r["resume_diff"] is None else f"{r['resume_diff']:.1e}"
        norms = f"{min(r['grad_norms']):.3g} to {max(r['grad_norms']):.3g}" if r["grad_norms"] else "not logged"
        print(
            f"| {r['release']} | {pipeline} | {stage} | {r['steps']} | {r['first']:.4f} | {r['last']:.4f} | {norms} | "
            f"{resumed} | {'loads' if r['loads'] else r['problems']} | {r['seconds']:.0f} |" + mark[passed(r)]
        )
    infer = [r for r in rows if r["name"].startswith("infer_")]
    if infer:
        print(
            "\n| release | batch_inference --eval_task | ZeRO | samples written | equal to plain transformers | seconds |"
        )
        print("| --- | --- | --- | --- | --- | --- |")
    for r in infer:
        task, stage = r["name"][len("infer_") :].rsplit("_", 1)
        if "error" in r:
            print(f"| {r['release']} | {task} | {stage} | FAILED: {r['error']} | | |")
        elif r["upstream"]:
            print(f"| {r['release']} | {task} | {stage} | stops at OpenRLHF's own bug, {r['upstream']} (README) | | |")
        else:
            equal = "not compared" if r["equal"] is None else f"{r['equal']} of {r['written']}"
            print(
                f"| {r['release']} | {task} | {stage} | {r['written']} | {equal} | {r['seconds']:.0f} |"
                + mark[passed(r)]
            )
    for r in rows:
        if r["name"] == "sft_2to3":
            if "error" in r:
                print(f"\nsft_2to3 FAILED: {r['error']}")
            else:
                print(
                    f"\n{r['release']} sft, ZeRO 2 checkpoint at step {RESUME_AT} resumed at ZeRO 3: final weights "
                    f"{r['resumed']:.1e} from the ZeRO 2 run's (the uninterrupted ZeRO 3 run: {r['uninterrupted']:.1e})"
                    + mark[passed(r)]
                )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/openrlhf-compat", help="scratch folder, emptied first")
    parser.add_argument("--release", choices=list(VENVS), nargs="*", help="releases to run (default: all)")
    parser.add_argument(
        "--only",
        nargs="*",
        help="runs to do, such as sft_2 kd_3 infer_generate_0 (default: all; sft_2to3 needs sft_2 and sft_3); "
        "ppo: only OpenRLHF's PPO under Ray, all its rows (ppo.py, in each --release's venv; default both)",
    )
    parser.add_argument(
        "--python",
        action="append",
        default=[],
        metavar="RELEASE=PATH",
        help="the Python of a release's venv (default: compat/openrlhf/.venv/bin/python, .venv-0.10.1/...)",
    )
    parser.add_argument("--child", metavar="RELEASE", help=argparse.SUPPRESS)  # run.py inside a release's venv
    args = parser.parse_args()
    if args.child:
        run_release(args.child, args.only, args.work)
        return

    pythons = {release: os.path.join(HERE, venv, "bin", "python") for release, venv in VENVS.items()}
    pythons.update(item.split("=", 1) for item in args.python)
    if args.only == ["ppo"]:  # ppo.py prints its own table, release by release
        codes = [
            subprocess.call([pythons[release], os.path.join(HERE, "ppo.py"), "--release", release])
            for release in args.release or list(VENVS)
        ]
        sys.exit(1 if any(codes) else 0)
    started, rows, failed = time.perf_counter(), [], False
    for release in args.release or list(VENVS):
        selected = [name for name in names(release) if not args.only or name in args.only]
        if not selected:
            continue
        if not os.path.exists(pythons[release]):
            print(f"{release}: no venv at {pythons[release]}: run bash compat/openrlhf/bootstrap.sh {release}")
            failed = True
            continue
        command = [pythons[release], os.path.abspath(__file__), "--child", release, "--only", *selected]
        child = subprocess.Popen(
            command + ["--work", os.path.join(args.work, release)], stdout=subprocess.PIPE, text=True
        )
        for line in child.stdout:
            if line.startswith("ROW "):
                rows.append(json.loads(line[len("ROW ") :]))
                print(f"{release} {rows[-1]['name']}: {'ok' if passed(rows[-1]) else 'FAILED'}", flush=True)
            else:
                print(line, end="", flush=True)
        failed |= child.wait() != 0
    print_tables(rows)
    failed |= not all(passed(r) for r in rows)
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
