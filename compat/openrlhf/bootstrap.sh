#!/usr/bin/env bash
# The virtual environment compat/openrlhf/run.py runs in: this project's requirements, OpenRLHF 0.8.5 without its
# dependencies (they pin vllm, ray, flash-attn and DeepSpeed 0.17.1), and only the packages that its SFT,
# reward-model and DPO pipelines import, at versions of the time of transformers 4.52.4 (May 2025); for PPO
# (ppo.py), OpenRLHF's own pin of ray, and torchdata, which OpenRLHF's own strategy module imports at its top (PPO's
# modules import that module for annotations and its offload helpers; nothing of it runs).
#
#   bash compat/openrlhf/bootstrap.sh && compat/openrlhf/.venv/bin/python compat/openrlhf/run.py
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
.venv/bin/pip install -q -r ../../requirements.txt
.venv/bin/pip install -q --no-deps openrlhf==0.8.5
.venv/bin/pip install -q transformers==4.52.4 accelerate==1.7.0 peft==0.15.2 datasets==3.6.0
.venv/bin/pip install -q ray==2.43.0
.venv/bin/pip install -q --no-deps torchdata==0.11.0
