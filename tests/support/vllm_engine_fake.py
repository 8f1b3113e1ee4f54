"""A stand-in for vLLM's ``LLM`` for bench/vllm_engine.py's CPU smoke test: its driver, end to end,
without a GPU. Every live request gets one token a step after one prefill step; each token's
logprob is a function of the request and position, so that two methods' runs compare equal."""

import os
import time
from types import SimpleNamespace


def params(osl: int):
    return SimpleNamespace(max_tokens=osl)


class _Engine:
    def __init__(self):
        self.live = {}

    def add_request(self, request_id, prompt, params):
        self.live[request_id] = {"isl": len(prompt["prompt_token_ids"]), "max": params.max_tokens, "tokens": []}

    def step(self):
        outputs = []
        for rid, req in list(self.live.items()):
            if req.pop("prefilled", None) is None and not req["tokens"]:
                req["prefilled"] = True  # the prefill step emits the first token next step
                continue
            token = (req["isl"] * 31 + len(req["tokens"])) % 997
            req["tokens"].append(token)
            logprobs = [{t: SimpleNamespace(logprob=-0.5 - (t % 7) / 10)} for t in req["tokens"]]
            finished = len(req["tokens"]) >= req["max"]
            completion = SimpleNamespace(token_ids=list(req["tokens"]), logprobs=logprobs)
            outputs.append(SimpleNamespace(request_id=rid, outputs=[completion], finished=finished))
            if finished:
                del self.live[rid]
        return outputs


class FakeLLM:
    def __init__(self, model: str, method: str):
        # FAKE_ENGINE_FAULT=method:fail|hang makes that method's engine start fail or never end
        fault = dict(item.split(":") for item in os.environ.get("FAKE_ENGINE_FAULT", "").split(",") if item)
        if fault.get(method) == "fail":
            raise RuntimeError(f"fake engine start failed for {method}")
        if fault.get(method) == "hang":
            time.sleep(600)
        self.llm_engine = _Engine()
        runner = SimpleNamespace(attn_groups=[], model=None)
        self._worker = SimpleNamespace(model_runner=runner)

    def collective_rpc(self, fn):
        return [fn(self._worker)]

    def reset_prefix_cache(self):
        return True
