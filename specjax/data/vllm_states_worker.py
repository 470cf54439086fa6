"""Run under the python of a vLLM environment (no specjax imports): one hs_{i}.safetensors per
prompt, from vLLM's `extract_hidden_states` speculative method.

    $VLLM_PYTHON specjax/data/vllm_states_worker.py JOB.json

JOB.json: {"target": DIR, "dtype": "bfloat16" | "float32", "layer_ids": [vLLM ids, ascending],
           "out_dir": DIR, "prompts": {"<i>": [token ids], ...}, "max_model_len": N,
           "engine_args": {more vllm.LLM kwargs}}

Each prompt runs once with max_tokens=1; the connector (vllm_hidden_states_connector.py, next to
this file) writes <out_dir>/hs_<i>.safetensors: `hidden_states` [len, layers, hidden] (the layer
ids' states in ascending order; vLLM id k is the input of decoder layer k, the id num_layers the
last layer's output before the final norm) and `token_ids` int64 [len]. Prompts whose file is
already there are not run again. Exit 0 once every file exists.
"""
from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main(job_path: str) -> int:
    with open(job_path) as f:
        job = json.load(f)
    out = os.path.abspath(job["out_dir"])
    os.makedirs(out, exist_ok=True)
    # vLLM imports the connector by module name: this folder on sys.path, and on PYTHONPATH for
    # engine processes it spawns
    sys.path.insert(0, HERE)
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    # the engine core in this process: LLM.generate returns when a request's token is out, before
    # the connector writes its file (one engine step later); stepping the engine here writes it
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    def path_of(i: str) -> str:
        return os.path.join(out, f"hs_{i}.safetensors")

    todo = {i: ids for i, ids in job["prompts"].items() if not os.path.isfile(path_of(i))}
    if not todo:
        return 0
    llm = LLM(model=job["target"], dtype=job["dtype"], max_model_len=int(job["max_model_len"]),
              skip_tokenizer_init=True,
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {
                                      "eagle_aux_hidden_state_layer_ids": [int(k) for k in job["layer_ids"]]}}},
              kv_transfer_config={"kv_connector": "SyncHiddenStatesConnector",
                                  "kv_connector_module_path": "vllm_hidden_states_connector",
                                  "kv_role": "kv_producer",
                                  "kv_connector_extra_config": {"shared_storage_path": out,
                                                                "allow_custom_save_path": True}},
              **job.get("engine_args", {}))
    keys = list(todo)
    params = [SamplingParams(max_tokens=1, temperature=0.0,
                             extra_args={"kv_transfer_params": {"hidden_states_path": path_of(i)}}) for i in keys]
    llm.generate([{"prompt_token_ids": [int(t) for t in todo[i]]} for i in keys], params, use_tqdm=False)
    deadline = time.monotonic() + 600
    while any(not os.path.isfile(path_of(i)) for i in keys):
        if time.monotonic() > deadline:
            missing = [i for i in keys if not os.path.isfile(path_of(i))]
            print(f"vllm_states_worker: {len(missing)} state files never written (first: {path_of(missing[0])})",
                  file=sys.stderr)
            return 1
        llm.llm_engine.step()
    for i in keys:
        lock = path_of(i) + ".lock"
        if os.path.exists(lock):
            os.remove(lock)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
