"""The pipeline over torch.distributed: rank 0 is a `Backend`, the other ranks follow its ops.

Every operation starts on rank 0 and travels down the ranks in order: a fixed int64 header
(op, cache id, count, two arguments, payload lengths), an int64 payload (cache ids to free,
tree parents, kept indices) and, for a forward, the hidden states. Each stage applies the op to
its own layers' cache, so crop, rollback and tree compaction happen on every stage in step. The
last stage sends the logits straight back to rank 0. Every wait has a timeout; when idle, rank 0
sends a keepalive so followers can tell a quiet leader from a dead one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from nodes.backends.base import Backend
from nodes.backends.tokenizer import Tokenizer
from nodes.shard.layout import ShardBrokenError
from nodes.shard.stage import StageModel, tree_inputs

log = logging.getLogger(__name__)

NOOP, FORWARD, CROP, COMPACT, STOP = range(5)
HEADER = 8  # op, cache, n, arg1, arg2, n_free, n_payload, reserved
ALL_ROWS, LAST_ROW = 0, 1


@dataclass(frozen=True)
class Op:
    """One parsed pipeline header plus its payload."""

    op: int
    cache: int
    n: int
    arg1: int
    arg2: int
    free: tuple[int, ...]
    payload: tuple[int, ...]

    def header(self) -> torch.Tensor:
        return torch.tensor([self.op, self.cache, self.n, self.arg1, self.arg2,
                             len(self.free), len(self.payload), 0], dtype=torch.int64)

    @classmethod
    def parse(cls, header: torch.Tensor, payload: torch.Tensor) -> Op:
        h = [int(x) for x in header.tolist()]
        nf, npl = h[5], h[6]
        if h[0] not in (NOOP, FORWARD, CROP, COMPACT, STOP) or nf < 0 or npl < 0:
            raise ShardBrokenError(f"bad pipeline header {h}")
        p = [int(x) for x in payload.tolist()]
        return cls(h[0], h[1], h[2], h[3], h[4], tuple(p[:nf]), tuple(p[nf:nf + npl]))


class Link:
    """Point-to-point sends and receives with a timeout on every wait."""

    def __init__(self, timeout_s: float, hidden: int, vocab: int) -> None:
        self.timeout = timedelta(seconds=timeout_s)
        self.hidden = hidden
        self.vocab = vocab

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:  # gloo raises RuntimeError for reset peers and timeouts
            raise ShardBrokenError(f"shard pipeline {what} failed: "
                                   f"{str(exc).splitlines()[0][:200]}") from None

    def send(self, tensor: torch.Tensor, dst: int, what: str) -> None:
        try:
            work = dist.isend(tensor.contiguous(), dst)
        except RuntimeError as exc:
            raise ShardBrokenError(f"shard pipeline {what} to rank {dst} failed: "
                                   f"{str(exc).splitlines()[0][:200]}") from None
        self._wait(work, f"{what} to rank {dst}")

    def recv(self, tensor: torch.Tensor, src: int, what: str) -> torch.Tensor:
        try:
            work = dist.irecv(tensor, src)
        except RuntimeError as exc:
            raise ShardBrokenError(f"shard pipeline {what} from rank {src} failed: "
                                   f"{str(exc).splitlines()[0][:200]}") from None
        self._wait(work, f"{what} from rank {src}")
        return tensor

    def send_op(self, op: Op, dst: int) -> None:
        self.send(op.header(), dst, "header")
        if op.free or op.payload:
            self.send(torch.tensor(op.free + op.payload, dtype=torch.int64), dst, "payload")

    def recv_op(self, src: int) -> Op:
        header = self.recv(torch.empty(HEADER, dtype=torch.int64), src, "header")
        n = int(header[5]) + int(header[6])
        if not 0 <= n <= 1 << 20:
            raise ShardBrokenError(f"bad pipeline payload length {n}")
        payload = (self.recv(torch.empty(n, dtype=torch.int64), src, "payload") if n
                   else torch.empty(0, dtype=torch.int64))
        return Op.parse(header, payload)


def init_group(store_host: str, store_port: int, rank: int, world: int, timeout_s: float,
               listen_fd: int | None = None) -> None:
    """Join the process group through rank 0's TCP store, on gloo (stages run on CPU; NCCL
    would need the activations on CUDA, not done yet).

    Rank 0 passes the socket it already listens on (bound to its node's address only)."""
    backend = "gloo"
    # the store takes its own copy of the socket: it closes it when it is done with it
    extra = ({"master_listen_fd": os.dup(listen_fd), "use_libuv": False}
             if listen_fd is not None else {})
    store = dist.TCPStore(store_host, store_port, world, is_master=rank == 0,
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=True, **extra)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def close_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except RuntimeError as exc:
            log.debug("destroy_process_group: %s", exc)


class _Cache:
    """Rank 0's handle on one sequence's cache; the stages hold theirs under the same id."""

    __slots__ = ("id", "local", "__weakref__")

    def __init__(self, id_: int, local: Any) -> None:
        self.id = id_
        self.local = local


class ShardedBackend(Backend):
    """Rank 0 of a pipeline: the same interface as TorchBackend; forwards cross every stage."""

    name = "torch"
    supports_tree = True

    def __init__(self, stage: StageModel, tokenizer: Tokenizer, model_name: str,
                 timeout_s: float, keepalive_s: float | None = None) -> None:
        self.stage = stage
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = int(stage.full_config.vocab_size)
        self.world = stage.part.world
        self.link = Link(timeout_s, int(stage.full_config.hidden_size), self.vocab_size)
        self._lock = threading.Lock()
        self._next_id = 0
        self._freed: list[int] = []  # appended by finalizers (any thread), drained under _lock
        self._last_op = time.monotonic()
        self.broken: str | None = None
        self._stop = threading.Event()
        self._keepalive_s = keepalive_s if keepalive_s is not None else timeout_s / 3
        self._pinger = threading.Thread(target=self._keepalive, name="shard-keepalive",
                                        daemon=True)
        self._pinger.start()

    # -- plumbing ---------------------------------------------------------------------------
    def _drain_freed(self) -> tuple[int, ...]:
        out = []
        while self._freed:
            out.append(self._freed.pop())
        return tuple(out)

    def _send(self, op: int, cache: int = -1, n: int = 0, arg1: int = 0, arg2: int = 0,
              payload: Sequence[int] = ()) -> None:
        """Caller holds _lock. Send one op to rank 1 (the others relay it)."""
        if self.broken:
            raise ShardBrokenError(f"shard pipeline is down: {self.broken}")
        try:
            self.link.send_op(Op(op, cache, n, arg1, arg2, self._drain_freed(),
                                 tuple(payload)), 1)
        except ShardBrokenError as exc:
            self.broken = str(exc)
            raise
        self._last_op = time.monotonic()

    def _keepalive(self) -> None:
        while not self._stop.wait(self._keepalive_s / 2):
            if time.monotonic() - self._last_op < self._keepalive_s or self.broken:
                continue
            if self._lock.acquire(blocking=False):
                try:
                    self._send(NOOP)
                except ShardBrokenError as exc:
                    log.warning("%s", exc)
                finally:
                    self._lock.release()

    def close(self) -> None:
        """Tell the stages to stop (best effort) and stop the keepalive."""
        self._stop.set()
        with self._lock:
            if not self.broken:
                try:
                    self._send(STOP)
                except ShardBrokenError:
                    pass
                self.broken = "closed"

    # -- Backend ----------------------------------------------------------------------------
    def new_cache(self) -> Any:
        with self._lock:
            self._next_id += 1
            handle = _Cache(self._next_id, self.stage.new_cache())
        weakref.finalize(handle, self._freed.append, handle.id)
        return handle

    def _pipeline(self, cache: _Cache, token_ids: Sequence[int], mode: int,
                  parents: Sequence[int] | None) -> np.ndarray:
        ids = [int(t) for t in token_ids]
        with self._lock:
            mask = pos = None
            if parents is not None:
                mask, pos = tree_inputs(self.stage.cache_length(cache.local), list(parents),
                                        self.stage.dtype, self.stage.device)
            hidden = self.stage.layers(self.stage.embed(ids), cache.local, pos, mask)
            self._send(FORWARD, cache.id, len(ids), mode, int(parents is not None),
                       list(parents) if parents is not None else ())
            try:
                self.link.send(hidden[0].float().cpu(), 1, "activations")
                rows = 1 if mode == LAST_ROW else len(ids)
                logits = self.link.recv(torch.empty(rows, self.vocab_size), self.world - 1,
                                        "logits")
            except ShardBrokenError as exc:
                self.broken = str(exc)
                raise
            self._last_op = time.monotonic()
        return logits.numpy()

    def forward(self, cache: Any, token_ids: Sequence[int]) -> np.ndarray:
        return self._pipeline(cache, token_ids, ALL_ROWS, None)

    def forward_last(self, cache: Any, token_ids: Sequence[int]) -> np.ndarray:
        return self._pipeline(cache, token_ids, LAST_ROW, None)[-1]

    def forward_tree(self, cache: Any, token_ids: Sequence[int],
                     parents: Sequence[int]) -> np.ndarray:
        return self._pipeline(cache, token_ids, ALL_ROWS, parents)

    def compact(self, cache: Any, base: int, keep: Sequence[int]) -> None:
        keep = [int(k) for k in keep]
        if keep == list(range(len(keep))):
            self.crop(cache, base + len(keep))
            return
        with self._lock:
            compact_cache(cache.local, base, keep)
            self._send(COMPACT, cache.id, len(keep), base, 0, keep)

    def cache_length(self, cache: Any) -> int:
        return self.stage.cache_length(cache.local)

    def crop(self, cache: Any, length: int) -> None:
        with self._lock:
            crop_cache(cache.local, length)
            self._send(CROP, cache.id, 0, int(length))


def crop_cache(cache: Any, length: int) -> None:
    extra = int(cache.get_seq_length()) - length
    if extra > 0:
        cache.crop(-extra)


def compact_cache(cache: Any, base: int, keep: Sequence[int]) -> None:
    idx = torch.tensor([base + i for i in keep], dtype=torch.long)
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or not layer.keys.numel():
            continue
        idx_d = idx.to(layer.keys.device)
        layer.keys = torch.cat([layer.keys[..., :base, :], layer.keys[..., idx_d, :]], dim=-2)
        layer.values = torch.cat([layer.values[..., :base, :], layer.values[..., idx_d, :]],
                                 dim=-2)


def follow(stage: StageModel, link: Link, stop: threading.Event | None = None) -> str:
    """A stage rank > 0: apply rank 0's ops until STOP; raises ShardBrokenError on a failure."""
    part = stage.part
    caches: dict[int, Any] = {}
    hidden_size = int(stage.full_config.hidden_size)
    while stop is None or not stop.is_set():
        op = link.recv_op(part.rank - 1)
        for cid in op.free:
            caches.pop(cid, None)
        if not part.last:
            link.send_op(op, part.rank + 1)
        if op.op == STOP:
            return "stopped"
        if op.op == NOOP:
            continue
        if op.op == FORWARD:
            if not 0 < op.n <= 1 << 16:
                raise ShardBrokenError(f"bad forward length {op.n}")
            hidden = link.recv(torch.empty(op.n, hidden_size), part.rank - 1, "activations")
            cache = caches.get(op.cache)
            if cache is None:
                cache = caches[op.cache] = stage.new_cache()
            mask = pos = None
            if op.arg2:
                mask, pos = tree_inputs(stage.cache_length(cache), list(op.payload),
                                        stage.dtype, stage.device)
            out = stage.layers(hidden[None].to(stage.device), cache, pos, mask)
            if part.last:
                link.send(stage.head(out, op.arg1 == LAST_ROW).cpu(), 0, "logits")
            else:
                link.send(out[0].float().cpu(), part.rank + 1, "activations")
        elif op.op in (CROP, COMPACT):
            cache = caches.get(op.cache)
            if cache is None:
                continue
            if op.op == CROP:
                crop_cache(cache, op.arg1)
            else:
                compact_cache(cache, op.arg1, op.payload)
    return "stopped"
