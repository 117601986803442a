"""Run OpenRLHF's own PPO (openrlhf.cli.train_ppo_ray) of 0.8.5 or 0.10.1 on get_strategy.py, on a CPU-only Ray
cluster.

    bash compat/openrlhf/bootstrap.sh                 # once: compat/openrlhf/.venv, with ray 2.43.0
    compat/openrlhf/.venv/bin/python compat/openrlhf/ppo.py [--work DIR] [--only reinforce_2 ...]
    bash compat/openrlhf/bootstrap.sh 0.10.1          # once: compat/openrlhf/.venv-0.10.1, with ray 2.48.0
    compat/openrlhf/.venv-0.10.1/bin/python compat/openrlhf/ppo.py --release 0.10.1 [--only reinforce_2 ...]
    python3 compat/openrlhf/run.py [--release 0.10.1] --only ppo      # the same, all rows, in the release's venv

OpenRLHF's code runs as installed but for one import line of cli/train_ppo_ray.py (its get_strategy), in a copy
run.py writes. Each launch starts Ray with logical GPUs (ray.init(num_gpus=8, num_cpus=16): Ray only counts
them), then runs train_ppo_ray as __main__ with its own argparse: the actor on 2 ranks, the reference and reward
model on 1, the critic on 2, one generation engine. Stand-ins cover what is GPU-only and outside the strategy,
from standins/ (first on PYTHONPATH): `vllm` (generation with Hugging Face's generate on the CPU, taking the
actor's weights over gloo: standins/vllm/ for 0.8.5's vLLM 0.9.1, standins/vllm-0.19/vllm/ for 0.10.1's vLLM
0.19.0), torch.cuda.current_device, synchronize and current_stream (sitecustomize.py), and run.py's flash_attn.

Rows, each at ZeRO 2 and 3, on run.py's tiny random Llama and 16 counting prompts (4 PPO steps of 4 prompts x 2
samples):
  reinforce: REINFORCE++ with a reward function (--remote_rm_url reward_func.py) and no critic;
  gae:       GAE with a critic and a reward model (random value heads), the reference and reward model offloaded;
  ema:       reinforce with --enable_ema (save_model then writes the EMA model); 0.8.5 only;
  gae_eval:  GAE with a critic scored by the reward function, the reference offloaded, evaluated; 0.10.1 only.
Each row: a full run saving a checkpoint after every step; a second launch with --load_checkpoint from the
checkpoint after step 2, whose steps 3 and 4 must log what the full run's did and whose saved model must equal
the full run's (ema: OpenRLHF does not checkpoint the EMA model, so the distance is reported); from_pretrained on
the saved folder. --strategy_dir runs the rows on another copy of get_strategy.py.
0.10.1's reinforce and gae_eval rows also evaluate after steps 2 and 4 (--eval_dataset, 4 other prompts,
--eval_steps 2), and its trainer saves a best checkpoint (best_global_step<N>) of the actor and the critic whenever
the evaluation's pass@1 (eval_default_pass1, the mean reward) is the best yet; the row needs one of each model,
whose record (checkpoint_complete.json) carries that metric. 0.10.1 evaluates only with --remote_rm_url
(train_ppo_ray.py asserts it), so its gae rows, which score with a reward model, cannot: gae_eval is GAE with one.
0.10.1 collects samples in the order its engine calls finish, which can differ between launches: its resumed runs
are held to a bound on the final weights, beside a second uninterrupted launch (README, and main() below).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import run  # noqa: E402  (run.py's copy of OpenRLHF, its flash_attn stand-in and its tiny model)

# The one line of OpenRLHF's PPO that changes; DistributedSampler is not imported on its path.
PPO_SWAP = (
    "cli/train_ppo_ray.py",
    "from openrlhf.utils import get_strategy\n",
    "from get_strategy import get_strategy\n",
)

PROMPTS, ROLLOUT, SAMPLES = 16, 4, 2  # 16 prompts, 4 a step, 2 samples each: 8 samples and 4 PPO steps
STEPS = PROMPTS // ROLLOUT
RESUME_AT = 2  # the second launch starts from the checkpoint after this step
ROWS = {"0.8.5": ("reinforce", "gae", "ema"), "0.10.1": ("reinforce", "gae", "gae_eval")}
STRATEGY_DIR = REPO  # the folder whose get_strategy.py the runs import (--strategy_dir)
RELEASE = "0.8.5"  # the release of OpenRLHF in this venv (--release)
# The stand-ins' folders, first on PYTHONPATH: 0.10.1's vLLM stand-in goes before 0.8.5's (standins/vllm).
STANDINS = {
    "0.8.5": [os.path.join(HERE, "standins")],
    "0.10.1": [os.path.join(HERE, "standins", "vllm-0.19"), os.path.join(HERE, "standins")],
}
EVAL_PROMPTS, EVAL_STEPS = 4, 2  # 0.10.1: 4 prompts not trained on, evaluated after steps 2 and 4
EVALUATED = ("reinforce", "gae_eval")  # 0.10.1's rows that evaluate and save best checkpoints

# The reward function of the reinforce and ema rows: the share of even numbers among the response's words.
REWARD_FUNC = """import torch


def reward_func(queries, prompts, labels):
    rewards = []
    for query, prompt in zip(queries, prompts):
        words = query[len(prompt):].replace("</s>", " ").split()
        rewards.append(sum(w.isdigit() and int(w) % 2 == 0 for w in words) / max(len(words), 1))
    rewards = torch.tensor(rewards)
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
"""


def fixtures(work):
    """run.py's tiny Llama and tokenizer, a reward model on it (random value head), the prompts, the reward file."""
    pretrain = run.fixtures(work)
    from openrlhf.models import get_llm_for_sequence_regression
    from transformers import AutoTokenizer

    reward = os.path.join(work, "reward")
    if RELEASE == "0.8.5":
        model = get_llm_for_sequence_regression(pretrain, "reward", init_value_head=True, bf16=False)
    else:  # 0.10.1 names the dtype param_dtype (bf16, the default its runs train in) and needs another attention
        model = get_llm_for_sequence_regression(pretrain, "reward", init_value_head=True, attn_implementation="eager")
    model.save_pretrained(reward)
    AutoTokenizer.from_pretrained(pretrain).save_pretrained(reward)
    rows = [{"input": f"count on from {n}"} for n in range(PROMPTS)]
    run.write(os.path.join(work, "prompts.jsonl"), "".join(json.dumps(row) + "\n" for row in rows))
    # 0.10.1's evaluation set: prompts the runs do not train on, so that the vLLM stand-in's seeds for them never
    # depend on whether an evaluation ran before a training step.
    rows = [{"input": f"count on from {n}"} for n in range(40, 40 + EVAL_PROMPTS)]
    run.write(os.path.join(work, "eval.jsonl"), "".join(json.dumps(row) + "\n" for row in rows))
    run.write(os.path.join(work, "reward_func.py"), REWARD_FUNC)
    return pretrain, reward


def flags(row, stage, work, pretrain, reward, out, resume):
    options = {
        "--pretrain": pretrain,
        "--prompt_data": os.path.join(work, "prompts.jsonl"),
        "--input_key": "input",
        "--max_samples": PROMPTS,
        "--rollout_batch_size": ROLLOUT,
        "--n_samples_per_prompt": SAMPLES,
        "--micro_rollout_batch_size": 2,
        "--train_batch_size": ROLLOUT * SAMPLES,  # one optimizer step a PPO step: 2 ranks x 2 micro-batches of 2
        "--micro_train_batch_size": 2,
        "--actor_num_gpus_per_node": 2,
        "--critic_num_gpus_per_node": 2,
        "--ref_num_gpus_per_node": 1,
        "--reward_num_gpus_per_node": 1,
        "--vllm_num_engines": 1,
        "--vllm_sync_backend": "gloo",
        "--zero_stage": stage,
        "--actor_learning_rate": "1e-3",
        "--critic_learning_rate": "1e-3",
        "--lr_warmup_ratio": 0,
        "--save_steps": 1,
        "--max_ckpt_num": 100,
        "--ckpt_path": os.path.join(out, "ckpt"),
        "--save_path": os.path.join(out, "final"),
        "--seed": 42,
    }
    if RELEASE == "0.8.5":
        options.update({"--prompt_max_len": 16, "--generate_max_len": 8})
    else:
        # 0.10.1 bounds prompt and response together (--max_len) and the response alone (--max_new_tokens). Its
        # default attention, flash_attention_2, needs a GPU: a flag, no stand-in.
        options.update({"--max_len": 24, "--max_new_tokens": 8, "--attn_implementation": "eager"})
        if row in EVALUATED:  # evaluation needs --remote_rm_url in 0.10.1; best_metric_key's default picks pass1
            options.update({"--eval_dataset": os.path.join(work, "eval.jsonl"), "--eval_steps": EVAL_STEPS})
    if row == "gae":
        options.update({"--advantage_estimator": "gae", "--reward_pretrain": reward})
        extra = ["--ref_reward_offload", "--save_value_network"]
    elif row == "gae_eval":  # the critic starts from the actor's model with a new value head, as OpenRLHF defaults
        options.update({"--advantage_estimator": "gae", "--remote_rm_url": os.path.join(work, "reward_func.py")})
        extra = ["--ref_reward_offload", "--save_value_network"]
    else:
        options.update({"--advantage_estimator": "reinforce", "--remote_rm_url": os.path.join(work, "reward_func.py")})
        extra = ["--enable_ema"] if row == "ema" else []
    if resume:
        extra.append("--load_checkpoint")
    return [str(item) for option in options.items() for item in option] + extra


def launch(row, stage, work, site, pretrain, reward, name, resume):
    """One driver process running train_ppo_ray under Ray; returns (seconds, {step: status logged})."""
    out = os.path.join(work, name)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--launch",
        *flags(row, stage, work, pretrain, reward, out, resume),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(
        PYTHONPATH=os.pathsep.join([*STANDINS[RELEASE], site, STRATEGY_DIR]),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        RAY_DEDUP_LOGS="0",  # every actor's lines, so each step's status is seen
    )
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=work)
    seconds = time.perf_counter() - started
    with open(os.path.join(work, f"{name}.log"), "w") as f:
        f.write(done.stdout)
    if done.returncode != 0:
        raise RuntimeError(
            f"{name} exited {done.returncode}; its output is in {work}/{name}.log:\n{done.stdout[-3000:]}"
        )
    # Each step's status as logged: {step: {key: the number's text}}; equal texts are equal numbers, to the last
    # printed digit (Python prints a float's shortest exact repr).
    steps = {int(step): numbers(text) for step, text in re.findall(r"Global step (\d+): (\{.*\})", done.stdout)}
    # 0.10.1's evaluations: {step: their metrics}.
    evals = re.findall(r"global_step (\d+), eval_metrics: (\{.*\})", done.stdout)
    return seconds, steps, {int(step): numbers(text) for step, text in evals}


def numbers(status):
    """A logged status (a dict's text, whose floats may be nan) as {key: the number's text}. 0.10.1 also logs each
    phase's seconds (timing/...), which no two runs share, and orders the keys as its actors answer: the timings
    are left out, and dicts compare whatever their order."""
    found = re.findall(r"'([^']+)': ([^,}]+)", status)
    return {key: text for key, text in found if not key.startswith("timing/")}


def value(status, key):
    return float(status[key])


def same_files(folder, other):
    """Whether two checkpoint folders hold the same tensors, to the bit, in every .pt file (DeepSpeed's model
    states, each rank's optimizer shard with its fp32 master weights and Adam moments, each rank's generators)."""
    import torch

    def tensors(x, prefix=""):
        if isinstance(x, dict):
            return {k: v for key, item in x.items() for k, v in tensors(item, f"{prefix}/{key}").items()}
        if isinstance(x, (list, tuple)):
            return {k: v for i, item in enumerate(x) for k, v in tensors(item, f"{prefix}/{i}").items()}
        return {prefix: x} if torch.is_tensor(x) else {}

    for name in sorted(n for n in os.listdir(folder) if n.endswith(".pt")):
        a, b = (
            tensors(torch.load(os.path.join(f, name), map_location="cpu", weights_only=False)) for f in (folder, other)
        )
        if a.keys() != b.keys() or not all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a):
            return False
    return True


def bf16_steps(weights, other):
    """The largest difference between two state dicts' weights, tensor by tensor in units of one bfloat16 rounding
    step at that tensor's largest magnitude (2 ** (floor(log2(max |w|)) - 7): bfloat16 keeps 8 significant bits)."""
    import math

    worst = 0.0
    for k, a in weights.items():
        a, b = a.float(), other[k].float()
        scale = a.abs().max().item()
        if scale > 0:
            worst = max(worst, (a - b).abs().max().item() / 2 ** (math.floor(math.log2(scale)) - 7))
    return worst


def resume(row, stage, work, site, pretrain, reward, source, name):
    """Launch `name` with --load_checkpoint from a copy of `source`'s checkpoints, latest naming step RESUME_AT."""
    resumed = os.path.join(work, name)
    shutil.rmtree(resumed, ignore_errors=True)
    shutil.copytree(os.path.join(work, source, "ckpt"), os.path.join(resumed, "ckpt"))
    for model in ("_actor", "_critic"):
        if os.path.isdir(os.path.join(resumed, "ckpt", model)):
            run.write(os.path.join(resumed, "ckpt", model, "latest"), f"global_step{RESUME_AT}")
    return launch(row, stage, work, site, pretrain, reward, name, resume=True)


def check(row, stage, work, site, pretrain, reward):
    import torch
    from transformers import AutoModelForCausalLM

    name = f"{row}_{stage}"
    seconds, full, evals = launch(row, stage, work, site, pretrain, reward, name, resume=False)
    assert sorted(full) == list(range(1, STEPS + 1)), f"steps logged: {sorted(full)}"
    actor_ckpt = os.path.join(work, name, "ckpt", "_actor")
    checkpoints = [n for n in os.listdir(actor_ckpt) if re.fullmatch(r"global_step\d+", n)]
    # 0.10.1's best checkpoints, each with the metric its record carries: {tag: {"key", "value"}}, for the actor
    # and (gae) the critic. Read before the resumed launch, which saves its own into a copy.
    best = {}
    for model in ("_actor", "_critic"):
        folder = os.path.join(work, name, "ckpt", model)
        for tag in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if tag.startswith("best"):
                with open(os.path.join(folder, tag, "checkpoint_complete.json")) as f:
                    best[f"{model[1:]}/{tag}"] = json.load(f)["metric"]
    # 0.10.1's evaluations, read from disk as well as from the interleaved output of Ray's processes (where a
    # line can be lost). At each step the trainer saves the regular checkpoint first, passing its latest evaluation,
    # and evaluates after: so the actor's global_step<k> carries the evaluation of the last evaluated step before k
    # (global_step4 carries step 2's), and a best checkpoint best_global_step<e> carries step e's own.
    on_disk = {}
    for tag in checkpoints:
        with open(os.path.join(actor_ckpt, tag, "checkpoint_complete.json")) as f:
            metric = json.load(f)["metric"]
        step = int(tag.removeprefix("global_step"))
        if metric and metric["key"] == "eval_default_pass1":
            on_disk[(step - 1) // EVAL_STEPS * EVAL_STEPS] = metric["value"]
    for tag, metric in best.items():  # "actor/best_global_step4": {"key", "value"}
        if metric and metric["key"] == "eval_default_pass1":
            on_disk[int(tag.rsplit("best_global_step", 1)[1])] = metric["value"]
    _, again, _ = resume(row, stage, work, site, pretrain, reward, source=name, name=f"{name}_resumed")
    # 0.10.1: the order of a step's samples may differ between any two launches (main()), so a second
    # uninterrupted launch is the yardstick for the resumed one.
    rerun = None
    if RELEASE == "0.10.1":
        launch(row, stage, work, site, pretrain, reward, f"{name}_rerun", resume=False)
        rerun = bf16_steps(
            run.saved_weights(os.path.join(work, name, "final")),
            run.saved_weights(os.path.join(work, f"{name}_rerun", "final")),
        )
    assert sorted(again) == list(range(RESUME_AT + 1, STEPS + 1)), f"resumed steps logged: {sorted(again)}"
    # 0.10.1's critic logs the mean of get_grad_norm over its micro-steps, and on a micro-step that ends no
    # optimizer step that is the previous step's norm: DeepSpeed keeps it in the engine, not in a checkpoint, so the
    # first micro-step after a resume reads 0.0 (with OpenRLHF's own strategy too). That one number of the first
    # resumed step is set aside here, and shown in the table.
    first = RESUME_AT + 1
    carried = {"critic_grad_norm": (full[first].get("critic_grad_norm"), again[first].get("critic_grad_norm"))}
    if RELEASE == "0.8.5" or carried["critic_grad_norm"][0] is None:
        carried = {}
    again[first] = {k: v for k, v in again[first].items() if k not in carried}
    same_steps = all(again[s] == {k: v for k, v in full[s].items() if s != first or k not in carried} for s in again)
    first_step_same = again[first] == {k: v for k, v in full[first].items() if k not in carried}
    # The checkpoints the first resumed step saved, against the full run's, file by file, to the bit.
    tag = f"global_step{RESUME_AT + 1}"
    same_checkpoint = all(
        same_files(
            os.path.join(work, name, "ckpt", model, tag), os.path.join(work, f"{name}_resumed", "ckpt", model, tag)
        )
        for model in ("_actor", "_critic")
        if os.path.isdir(os.path.join(work, name, "ckpt", model))
    )
    final = run.saved_weights(os.path.join(work, name, "final"))
    resumed_final = run.saved_weights(os.path.join(work, f"{name}_resumed", "final"))
    resume_diff, resume_steps = run.max_abs_diff(final, resumed_final), bf16_steps(final, resumed_final)
    loaded, info = AutoModelForCausalLM.from_pretrained(os.path.join(work, name, "final"), output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    # In float32: 0.10.1 saves bfloat16 weights, which from_pretrained may load in another dtype (exactly).
    weights = loaded.state_dict()
    equal = all(torch.equal(weights[k].float(), v.float()) for k, v in final.items() if k in weights)
    key = "critic_loss" if row.startswith("gae") else "policy_loss"
    metric = "eval_default_pass1"  # 0.10.1's pass@1 on the evaluation set (datasource "default"): the mean reward
    return dict(
        best=best,
        evals={**{step: value(text, metric) for step, text in evals.items()}, **on_disk},  # what the disk says wins
        row=row,
        stage=stage,
        checkpoints=len(checkpoints),
        rewards=[value(full[s], "reward") for s in sorted(full)],
        losses=[value(full[s], key) for s in sorted(full)],
        loss_name=key,
        same_steps=same_steps,
        carried=carried,
        first_step_same=first_step_same,
        same_checkpoint=same_checkpoint,
        resume_diff=resume_diff,
        resume_steps=resume_steps,
        rerun=rerun,
        loads=not problems and equal,
        problems=problems,
        seconds=seconds,
    )


def launched():
    """The driver: Ray with logical GPUs, then OpenRLHF's train_ppo_ray as __main__ with the flags after --launch."""
    import runpy

    import ray

    ray.init(num_gpus=8, num_cpus=16, include_dashboard=False, object_store_memory=256 * 1024**2)
    try:
        sys.argv = ["train_ppo_ray", *sys.argv[2:]]
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)
    finally:
        ray.shutdown()


def resumed_steps(r):
    """The resumed-steps cell of a row whose steps differ: which of them held (0.10.1)."""
    if RELEASE == "0.8.5":
        return "NO"
    first = "step 3 equal" if r["first_step_same"] else "step 3 differs"
    checkpoint = "its checkpoint equal" if r["same_checkpoint"] else "its checkpoint differs"
    return f"no: {first}, {checkpoint}; sample order (README)"


def carried(r):
    """The critic_grad_norm set aside at the first resumed step (0.10.1's gae rows): full run's, resumed run's."""
    return "".join(f" (but {k}: {a} vs {b}, README)" for k, (a, b) in r["carried"].items())


def ulps(r):
    """0.10.1: the resumed run's distance in bfloat16 rounding steps, and the second uninterrupted launch's."""
    if RELEASE == "0.8.5":
        return ""
    rerun = "" if r["rerun"] is None else f"; a second full launch: {r['rerun']:.2g} steps"
    return f" ({r['resume_steps']:.2g} bf16 steps{rerun})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--work", default=None, help="scratch folder, emptied first (/tmp/openrlhf-compat-ppo[-0.10.1])"
    )
    parser.add_argument("--only", nargs="*", help="rows to run, such as reinforce_2 gae_3 (default: all)")
    parser.add_argument(
        "--strategy_dir", default=REPO, help="the folder of the get_strategy.py to run (a scratch copy)"
    )
    parser.add_argument("--release", choices=list(ROWS), default="0.8.5", help="the OpenRLHF in this venv")
    args = parser.parse_args(argv)
    global STRATEGY_DIR, RELEASE
    STRATEGY_DIR, RELEASE = os.path.abspath(args.strategy_dir), args.release
    from importlib.metadata import version

    assert version("openrlhf") == RELEASE, f"this venv holds OpenRLHF {version('openrlhf')}, not {RELEASE}"
    work = args.work or "/tmp/openrlhf-compat-ppo" + ("" if RELEASE == "0.8.5" else f"-{RELEASE}")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    args.work = work
    site = run.patched_openrlhf(args.work, RELEASE)
    path, old, new = PPO_SWAP
    text = open(os.path.join(site, "openrlhf", path)).read()
    assert text.count(old) == 1, f"{path}: expected the line {old!r} once"
    run.write(os.path.join(site, "openrlhf", path), text.replace(old, new))
    sys.path[:0] = [site, REPO]
    pretrain, reward = fixtures(args.work)
    rows = [(r, s) for r in ROWS[RELEASE] for s in (2, 3) if not args.only or f"{r}_{s}" in args.only]
    print(
        "| release | row | ZeRO | PPO steps | checkpoints | best checkpoints: metric | reward, step 1 → 4 | "
        "loss, step 1 → 4 | resumed steps 3-4 equal | resumed vs full run, max abs weight diff | from_pretrained | "
        "seconds (full run) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    failed = False
    for row, stage in rows:
        try:
            r = check(row, stage, args.work, site, pretrain, reward)
        except Exception as error:  # report and go on, so one failure does not hide the others
            print(f"| {RELEASE} | {row} | {stage} | FAILED: {str(error).splitlines()[0]} | | | | | | | | |", flush=True)
            failed = True
            continue
        if RELEASE == "0.8.5":  # generation in one synchronous call: the resumed steps are the full run's, exactly
            exact = r["resume_diff"] == 0 or row == "ema"  # OpenRLHF does not checkpoint the EMA model
            resumed = r["same_steps"] and exact
        else:
            # 0.10.1 collects a step's samples in the order their engine calls finish (ray.wait in
            # samples_generator.py; with a reward function OpenRLHF also runs it in a thread, utils/agent.py), which
            # can differ between any two launches, and with it the micro-batches and the rounding of their bfloat16
            # sums. The final weights are held to 2 bfloat16 rounding steps of each tensor's largest weight, or to
            # a second uninterrupted launch's distance from the first where that is larger (in the same steps);
            # where the order happened to be the full run's, the table shows the resumed steps equal (but the
            # critic_grad_norm set aside above) and the weights equal.
            resumed = r["resume_steps"] <= max(2, r["rerun"])
        ok = r["checkpoints"] == STEPS and resumed and r["loads"]
        if RELEASE == "0.10.1" and row in EVALUATED:  # a best checkpoint of each model, carrying the best metric
            models = {"actor", "critic"} if row.startswith("gae") else {"actor"}
            ok &= {tag.split("/")[0] for tag in r["best"]} == models
            ok &= all(m and m["key"] == "eval_default_pass1" for m in r["best"].values())
            ok &= all(m["value"] == max(r["evals"].values()) for m in r["best"].values())
        best = "; ".join(f"{tag}: {m['key']}={m['value']:.4f}" for tag, m in r["best"].items() if m) or "none"
        if RELEASE == "0.8.5":
            best = "(0.8.5 has none)"
        elif row == "gae":
            best = "none: no evaluation (README)"
        failed |= not ok
        print(
            f"| {RELEASE} | {row} | {stage} | {len(r['rewards'])} | {r['checkpoints']} | {best} | "
            f"{r['rewards'][0]:.4f} → {r['rewards'][-1]:.4f} | {r['loss_name']} {r['losses'][0]:.4f} → {r['losses'][-1]:.4f} | "
            f"{'yes' if r['same_steps'] else resumed_steps(r)}{carried(r)} | {r['resume_diff']:.1e}{ulps(r)} | "
            f"{'loads' if r['loads'] else r['problems']} | "
            f"{r['seconds']:.0f} |" + ("" if ok else " <- FAILED"),
            flush=True,
        )
        if r["evals"]:
            print(f"    evaluations (eval_default_pass1 by step): {r['evals']}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--launch"]:
        launched()
    else:
        sys.exit(main())
