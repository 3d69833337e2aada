"""vLLM's ExampleHiddenStatesConnector for the CPU build (tests only): the same file and lock protocol, without the
CUDA copy stream, CUDA events and pinned host memory the upstream class uses for its device-to-host copy.

Loaded by `vllm serve` through `kv_connector_module_path` (the module must be importable in the vLLM venv; the test
tooling puts scripts/vllm_cpu on PYTHONPATH). Only `_submit_async_write` differs: on CPU the states are already in
host memory, so the copy is synchronous and the "copy done" event is one that has always completed. The lock file
(created with LOCK_EX before the client gets the path, released by closing it after `save_file`), the writer thread
pool and the file names are the upstream ones.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as upstream


class _DoneEvent:
    """Stands in for torch.cuda.Event after a synchronous CPU copy: it has completed."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class ExampleHiddenStatesConnector(upstream.ExampleHiddenStatesConnector):
    """Same name as the upstream connector, so the server's `kv_connector` value stays what `vllm-command` prints."""

    def _submit_async_write(self, pending: upstream.PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(0, self._block_size, dtype=torch.long)
        slot_mapping = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        hidden_states = upstream.extract_from_kv_cache(self._kv_cache, slot_mapping, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}
        assert self._req_futures.get(pending.req_id) is None, "Found another KV transfer request with same req_id!"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _DoneEvent()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done  # type: ignore[assignment]
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
