"""A stand-in for vLLM 0.9.1, OpenRLHF 0.8.5's pin, for a machine without a GPU: it answers the calls that
OpenRLHF's engine wrapper (openrlhf/trainer/ray/vllm_engine.py, LLMRayActor) makes of vllm.LLM, and generates
with Hugging Face's generate on the CPU.

- LLM(model=..., seed=..., worker_extension_cls=..., ...) loads the model in float32, the dtype the actor trains
  in here (OpenRLHF asks for bfloat16, which its actor sends only with --bf16). The other options, about GPU
  memory, CUDA graphs and the prefix cache, have nothing to act on.
- collective_rpc(name, args) calls a method of the worker, as vLLM does: the worker is OpenRLHF's own WorkerWrap
  (vllm_worker_wrap.py) over a CPU worker, so OpenRLHF's init_process_group joins the actor's rank 0 over
  --vllm_sync_backend gloo. Only update_weight is this file's: WorkerWrap's allocates the received weight on "cuda".
- generate(prompts, sampling_params) samples each prompt alone, seeded by the engine's seed, the request's place in
  the call and its tokens: the same weights and prompts give the same samples in any run, so a resumed run
  generates what the uninterrupted one did.
"""

import importlib
import zlib
from types import SimpleNamespace

import torch
import torch.distributed as dist

__version__ = "0.9.1"


class SamplingParams:
    def __init__(self, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=16, min_tokens=0, **ignored):
        # ignored: skip_special_tokens and include_stop_str_in_output, which concern text; the stand-in returns tokens
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.max_tokens, self.min_tokens = max_tokens, min_tokens


class CPUWorker:
    """What WorkerWrap reads of a vLLM worker: model_config.dtype, model_runner.model.load_weights and device."""

    def __init__(self, model):
        self.model_config = SimpleNamespace(dtype=model.dtype)
        self.model_runner = SimpleNamespace(model=SimpleNamespace(load_weights=self.load_weights))
        self.device = torch.device("cpu")
        self.hf_model = model

    def load_weights(self, weights):
        params = dict(self.hf_model.named_parameters())
        for name, weight in weights:
            params[name].data.copy_(weight)

    def update_weight(self, name, dtype, shape, empty_cache=False):
        """WorkerWrap.update_weight on the CPU: receive one weight from the actor's rank 0 and load it."""
        assert dtype == self.model_config.dtype, f"mismatch dtype: src {dtype}, dst {self.model_config.dtype}"
        weight = torch.empty(shape, dtype=dtype)
        dist.broadcast(weight, 0, group=self._model_update_group)
        self.model_runner.model.load_weights(weights=[(name, weight)])


class LLM:
    def __init__(self, model, seed=0, worker_extension_cls=None, **ignored):
        from transformers import AutoModelForCausalLM

        self.seed = seed
        self.model = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
        # A vLLM worker is a rank of its tensor-parallel process group, and WorkerWrap asserts that one exists: here
        # a world of one.
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        module, name = worker_extension_cls.rsplit(".", 1)
        worker_cls = type("Worker", (CPUWorker, getattr(importlib.import_module(module), name)), {})
        self.worker = worker_cls(self.model)
        self.llm_engine = SimpleNamespace(reset_prefix_cache=lambda: None)  # no prefix cache to reset

    def collective_rpc(self, method, args=(), kwargs=None):
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def sleep(self, level=1):  # vLLM frees its GPU memory; there is none
        pass

    def wake_up(self):
        pass

    @torch.no_grad()
    def generate(self, prompts, sampling_params):
        p = sampling_params
        config = self.model.generation_config
        outputs = []
        for i, prompt in enumerate(prompts):
            ids = list(prompt["prompt_token_ids"])
            torch.manual_seed(zlib.crc32(repr((self.seed, i, ids)).encode()))
            sequence = self.model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=p.temperature > 0,
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=max(p.top_k, 0),  # vLLM's -1 and Hugging Face's 0 both mean no top-k
                max_new_tokens=p.max_tokens,
                min_new_tokens=p.min_tokens,
                eos_token_id=config.eos_token_id,
                pad_token_id=config.pad_token_id,
            )[0]
            completion = SimpleNamespace(token_ids=sequence[len(ids) :].tolist())
            outputs.append(SimpleNamespace(prompt_token_ids=ids, outputs=[completion]))
        return outputs
