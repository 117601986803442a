#!/usr/bin/env bash
# The virtual environment compat/openrlhf/run.py runs a release of OpenRLHF in: this project's requirements (so
# DeepSpeed 0.19.8 rather than the release's own pin), the release without its dependencies (they pin vllm, ray,
# flash-attn and DeepSpeed), and only the packages that its pipelines import, at the versions the release pins.
# For PPO (ppo.py), also the release's own pin of ray, and torchdata without its dependencies: OpenRLHF's own
# strategy module imports it at its top, and PPO's modules import that module (nothing of it runs).
#
#   bash compat/openrlhf/bootstrap.sh          # 0.8.5, in compat/openrlhf/.venv
#   bash compat/openrlhf/bootstrap.sh 0.10.1   # 0.10.1, in compat/openrlhf/.venv-0.10.1
set -euo pipefail
release=${1:-0.8.5}
cd "$(dirname "$0")"
case $release in
    0.8.5)
        # 0.8.5 pins no transformers: these are versions of the time of transformers 4.52.4 (May 2025). Its
        # batch_inference also imports jsonlines.
        venv=.venv
        packages=(transformers==4.52.4 accelerate==1.7.0 peft==0.15.2 datasets==3.6.0 jsonlines==4.0.0 ray==2.43.0)
        ;;
    0.10.1)
        # 0.10.1 pins transformers 5.5.3 (and through it huggingface-hub 1.x) but leaves accelerate, peft and
        # datasets free: these are the releases pip chose on 2026-12-01, the newest that fit that transformers.
        # Its openrlhf.utils imports pylatexenc at the top (a grader for math answers). For its PPO: ray 2.48.0,
        # its pin (of ray[default]: only ray itself is needed, and aiohttp, the one package of that extra its PPO
        # imports: utils/agent.py, at its top, for rewards over HTTP), and pillow, which utils/vlm_utils.py imports at
        # its top (the actor imports it; without images nothing of it runs).
        venv=.venv-0.10.1
        packages=(transformers==5.5.3 accelerate==1.15.0 peft==0.21.2 datasets==5.2.0 pylatexenc==2.11
            ray==2.48.0 aiohttp==3.13.2 pillow==12.0.0)
        ;;
    *)
        echo "usage: bootstrap.sh [0.8.5|0.10.1]" >&2
        exit 2
        ;;
esac
python3 -m venv "$venv"
"$venv"/bin/pip install -q -r ../../requirements.txt
"$venv"/bin/pip install -q --no-deps "openrlhf==$release"
"$venv"/bin/pip install -q "${packages[@]}"
# Both releases' strategy modules import torchdata (0.11.0 is the newest; its dependencies are not needed here).
"$venv"/bin/pip install -q --no-deps torchdata==0.11.0
