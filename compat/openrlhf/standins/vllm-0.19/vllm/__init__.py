"""A stand-in for vLLM 0.19.0, OpenRLHF 0.10.1's pin, for a machine without a GPU: it answers the calls that
OpenRLHF 0.10.1's engine actor (openrlhf/trainer/ray/vllm_engine.py, LLMRayActor) makes of vllm.AsyncLLMEngine,
and generates with Hugging Face's generate on the CPU. (0.8.5's stand-in, for vLLM 0.9.1's synchronous vllm.LLM,
is ../../vllm/.)

- AsyncEngineArgs(model=..., seed=..., dtype=..., worker_extension_cls=..., ...) and
  AsyncLLMEngine.from_engine_args(args) load the model in the dtype OpenRLHF asks for (bfloat16, the dtype its
  actor trains in with the default --param_dtype bf16). The other options, about GPU memory, CUDA graphs, the
  prefix cache and sleep mode, have nothing to act on.
- collective_rpc(name, args) calls a method of the worker, as vLLM does: the worker is OpenRLHF's own WorkerWrap
  (vllm_worker_wrap.py) over a CPU worker, so OpenRLHF's init_process_group runs and joins the actor's rank 0
  through vllm.distributed's StatelessProcessGroup and PyNcclCommunicator, both stand-ins here (distributed/),
  over gloo instead of NCCL. Only update_weight is this file's: WorkerWrap's allocates the received weight on
  "cuda".
- generate(prompt, sampling_params, request_id) is an async generator yielding one finished RequestOutput. OpenRLHF
  0.10.1 sends one request per sample (n_samples_per_prompt requests of the same prompt at once), so each request
  is seeded by the engine's seed, the prompt's tokens and how many requests of that prompt came before it since
  the weights last changed: the same weights and prompts give the same samples in any launch, a resumed one too.
"""

import importlib
import zlib
from types import SimpleNamespace

import torch
import torch.distributed as dist

__version__ = "0.19.0"


class SamplingParams:
    def __init__(self, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=16, min_tokens=0, logprobs=None, **ignored):
        # ignored: skip_special_tokens and include_stop_str_in_output, which concern text; the stand-in returns tokens
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.max_tokens, self.min_tokens, self.logprobs = max_tokens, min_tokens, logprobs
        if logprobs is not None:  # --enable_vllm_is_correction; the rows here do not use it
            raise NotImplementedError("the vLLM stand-in returns no logprobs")


class CPUWorker:
    """What WorkerWrap reads of a vLLM worker: model_config.dtype, model_runner.model.load_weights and device."""

    def __init__(self, model):
        self.model_config = SimpleNamespace(dtype=model.dtype)
        self.model_runner = SimpleNamespace(model=SimpleNamespace(load_weights=self.load_weights))
        self.device = torch.device("cpu")
        self.hf_model = model
        self.weights_changed = []  # callbacks run when a weight arrives (the engine's seeding counts restart)

    def load_weights(self, weights):
        params = dict(self.hf_model.named_parameters())
        for name, weight in weights:
            params[name].data.copy_(weight)
        for callback in self.weights_changed:
            callback()

    def update_weight(self, name, dtype, shape, empty_cache=False):
        """WorkerWrap.update_weight on the CPU: receive one weight from the actor's rank 0 and load it."""
        assert dtype == self.model_config.dtype, f"mismatch dtype: src {dtype}, dst {self.model_config.dtype}"
        weight = torch.empty(shape, dtype=dtype)
        self._model_update_group.broadcast(weight, src=0)
        self.model_runner.model.load_weights(weights=[(name, weight)])


class AsyncEngineArgs:
    def __init__(self, model, seed=0, dtype="auto", worker_extension_cls=None, **ignored):
        self.model, self.seed, self.dtype, self.worker_extension_cls = model, seed, dtype, worker_extension_cls


class AsyncLLMEngine:
    @classmethod
    def from_engine_args(cls, engine_args):
        return cls(engine_args)

    def __init__(self, engine_args):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}[engine_args.dtype]
        self.seed = engine_args.seed
        self.model = AutoModelForCausalLM.from_pretrained(
            engine_args.model, dtype=dtype, attn_implementation="eager"
        ).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(engine_args.model)
        # A vLLM worker is a rank of its tensor-parallel process group, and WorkerWrap asserts that one exists: here
        # a world of one.
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        module, name = engine_args.worker_extension_cls.rsplit(".", 1)
        worker_cls = type("Worker", (CPUWorker, getattr(importlib.import_module(module), name)), {})
        self.worker = worker_cls(self.model)
        self.requests = {}  # prompt tokens -> requests of that prompt since the weights last changed
        self.worker.weights_changed.append(self.requests.clear)
        # LLMRayActor balances requests over engines by this count; each request here finishes within its call.
        self.output_processor = SimpleNamespace(get_num_unfinished_requests=lambda: 0)

    async def is_sleeping(self):
        return False

    async def collective_rpc(self, method, args=(), kwargs=None):
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    async def reset_prefix_cache(self):  # no prefix cache to reset
        pass

    async def sleep(self, level=1):  # vLLM frees its GPU memory; there is none
        pass

    async def wake_up(self, tags=None):
        pass

    async def pause_generation(self, mode="keep"):  # --partial_rollout; each request here finishes within its call
        pass

    async def resume_generation(self):
        pass

    async def generate(self, prompt, sampling_params, request_id=None):
        """One request: the prompt's tokens sampled on alone, yielded once, finished."""
        p = sampling_params
        ids = list(prompt["prompt_token_ids"])
        key = tuple(ids)
        count = self.requests.get(key, 0)
        self.requests[key] = count + 1
        config = self.model.generation_config
        torch.manual_seed(zlib.crc32(repr((self.seed, count, ids)).encode()))
        with torch.no_grad():
            sequence = self.model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=p.temperature > 0,
                temperature=p.temperature if p.temperature > 0 else None,
                top_p=p.top_p,
                top_k=max(p.top_k, 0),  # vLLM's -1 and Hugging Face's 0 both mean no top-k
                max_new_tokens=p.max_tokens,
                min_new_tokens=p.min_tokens,
                eos_token_id=config.eos_token_id,
                pad_token_id=config.pad_token_id,
            )[0]
        tokens = sequence[len(ids) :].tolist()
        finish = "stop" if tokens and tokens[-1] == config.eos_token_id else "length"
        completion = SimpleNamespace(
            token_ids=tokens,
            text=self.tokenizer.decode(tokens),
            finish_reason=finish,
            logprobs=None,
        )
        yield SimpleNamespace(request_id=request_id, prompt_token_ids=ids, outputs=[completion], finished=True)
