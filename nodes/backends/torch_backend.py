"""torch/transformers backend: CPU here, CUDA or MPS when present."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from nodes import models
from nodes.backends import few_rows, growing_cache, quant_forward, torch_batch, torch_lean
from nodes.backends.base import Backend, tree_layout
from nodes.backends.kv_bound import MAX_KV_BOUND, check_kv_bound  # noqa: F401 - re-exported
from nodes.backends.tokenizer import Tokenizer
from nodes.engine.errors import BadRequestError, ModelNotFoundError

log = logging.getLogger(__name__)

#: the environment switch that keeps transformers' own forward where the lean one would serve
#: (benchmarks compare both): SPECBUS_FORWARD=transformers
FORWARD_ENV = "SPECBUS_FORWARD"


def default_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


class TorchBackend(Backend):
    """A transformers causal LM with a `DynamicCache` per sequence."""

    name = "torch"
    supports_tree = True

    def __init__(self, model: Any, tokenizer: Tokenizer, model_name: str, device: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.device = device
        self.vocab_size = int(model.config.vocab_size)
        self._hooked = False  # pre-hooks on the decoder layers, installed at the first capture
        self._tap: dict[int, Any] | None = None  # layer -> its input, during a capturing forward
        #: run a batch one sequence at a time, so each sequence's logits are bit for bit
        #: those it gets alone (docs/engine.md, "Batching": batched CPU matmuls differ)
        self.batch_invariant = False
        #: the lean float32 forward (`torch_lean`), where it reproduces the model's own, or
        #: the quantized forward (`quant_forward`) under `--weights q8|q4`
        self.lean: torch_lean.LeanForward | quant_forward.QuantForward | None = None
        #: the weights the forward computes with: "fp32" (the reference mode) or a quantized
        #: form as `quant_forward` names it
        self.weights = "fp32"
        self._verify_costs: dict[int, float] | None = None
        #: (sink, window) of bounded K/V on full-attention layers (`bound_kv`), or None
        self.kv_bound: tuple[int, int] | None = None
        #: the model has sliding-window layers: every forward goes through `torch_batch`,
        #: whose masks apply each layer's window (growing_cache.WindowLayer)
        self.windowed = growing_cache.windowed(model.config)

    @classmethod
    def load(cls, model_ref: str | None = None, device: str | None = None,
             weights: str = "fp32") -> TorchBackend:
        """Load `model_ref`; `weights` (nodes/backends/weights.py) "q8", "q4" or "file" serves
        it through the quantized forward (CPU, Llama layouts: `quant_forward` says why), "auto"
        where it serves the model's own GGUF blocks, "fp32" keeps the reference mode."""
        if weights not in (*quant_forward.WEIGHTS, quant_forward.AUTO):
            raise BadRequestError(f"--weights {weights!r}: choose one of "
                                  f"{', '.join(quant_forward.WEIGHTS)} or auto")
        ref = models.resolve(model_ref)
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # our CLI prints its own progress, not per-tensor bars
        device = device or default_device()
        try:
            tokenizer = Tokenizer(ref.path)
            model = AutoModelForCausalLM.from_pretrained(
                str(ref.path), local_files_only=True, dtype=torch.float32
            )
        except (OSError, ValueError, KeyError) as exc:
            raise ModelNotFoundError(
                f"model {ref.name!r}: could not load from {ref.path}: {exc}".splitlines()[0]
            ) from None
        model.to(device).eval()
        if device == "cpu":
            few_rows.install(model)  # verify forwards' 2-16 rows at ~1-token cost (why: there)
        backend = cls(model, tokenizer, ref.name, device)
        auto = weights == quant_forward.AUTO
        if auto:
            weights = _auto_weights(ref, device)
        if weights == "fp32":
            backend.lean = _lean_forward(model)
        else:
            try:
                backend.lean = _quant_forward(model, ref, weights, device)
                backend.weights = backend.lean.form
            except BadRequestError as exc:
                if not auto:
                    raise
                log.info("weights auto: fp32 (%s)", exc)
                backend.lean = _lean_forward(model)
        return backend

    def verify_costs(self) -> dict[int, float]:
        """Seconds a forward of n rows takes after 64 cached positions, measured once (the
        fastest of 3) for the quantized forward, whose curve is far from the cost model's prior
        (each further row ~a third of a step: products of per-block-scaled integers are
        compute-bound); {} for the fp32 forwards, which the prior fits."""
        if not isinstance(self.lean, quant_forward.QuantForward):
            return {}
        if self._verify_costs is None:
            import time

            cache = self.new_cache()
            self.forward(cache, list(range(1000, 1064)))
            costs = {}
            for fed in (1, 2, 3, 4, 6, 8, 12, 16):
                best = float("inf")
                for _ in range(3):
                    t = time.perf_counter()
                    self.forward(cache, list(range(100, 100 + fed)))
                    best = min(best, time.perf_counter() - t)
                    self.crop(cache, 64)
                costs[fed] = best
            self._verify_costs = costs
            log.info("verify cost, ms by rows fed: %s", ", ".join(
                f"{n}: {s * 1e3:.1f}" for n, s in costs.items()))
        return dict(self._verify_costs)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Tokenizer, model_name: str) -> TorchBackend:
        """Wrap an already-built model (e.g. the int8 quantised copy)."""
        model.eval()
        return cls(model, tokenizer, model_name, "cpu")

    def new_cache(self) -> Any:
        return growing_cache.new_cache(self.model.config, self.kv_bound)

    def bound_kv(self, sink: int | None, window: int | None) -> None:
        """Bound every full-attention layer's K/V to the first `sink` positions and the last
        `window` (`--kv-sink/--kv-window`; both or neither): a band mask, the sinks at
        re-indexed positions (StreamingLLM's: at most S + W - 1 from the query, rotated with the
        model's RoPE, `growing_cache.rope_inv_freq`), the rest dropped
        (growing_cache.BoundedLayer). Its prefix cache hands over
        only prefixes whose window is still held (`prefix_floor`): a chat's next turn, the
        whole of the last one."""
        bound = check_kv_bound(sink, window, self.model.config)
        if bound is not None and isinstance(self.lean, quant_forward.QuantForward):
            # it writes each position at its own row; a bounded layer's rows are not positions
            raise BadRequestError(f"--kv-sink/--kv-window: the quantized forward (weights "
                                  f"{self.weights}) does not serve bounded K/V; add "
                                  "--weights fp32")
        if bound is not None:
            try:  # the layers' RoPE frequencies, once: a model they cannot be had for is refused
                growing_cache.new_cache(self.model.config, bound)
            except (ValueError, KeyError) as exc:
                raise BadRequestError(f"--kv-sink/--kv-window: {exc}") from None
        self.kv_bound = bound
        if self.kv_bound is not None:
            log.info("kv: bounded to %d sink + %d window positions per full-attention layer "
                     "(re-indexed sink positions)", *self.kv_bound)

    def kv_bytes(self, cache: Any) -> int:
        """Bytes of the K/V buffers `cache` holds (room ahead included)."""
        return growing_cache.kv_bytes(cache)

    @property
    def _banded(self) -> bool:
        """Whether forwards must go through `torch_batch` (its masks apply the bands)."""
        return self.windowed or self.kv_bound is not None

    # ---- hidden states for heads that read them (EAGLE-3) ------------------------------------
    @property
    def decoder_layers(self) -> Any:
        """The model's decoder layer list (Llama-family layout: `model.model.layers`)."""
        inner = getattr(self.model, "model", None)
        layers = getattr(inner, "layers", None)
        if layers is None:
            raise BadRequestError(f"model {self.model_name!r}: no decoder layer list found; "
                                  "hidden states can be captured only from Llama-style models")
        return layers

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    def capture_hidden(self, cache: Any, layers: Sequence[int]) -> None:
        layers = tuple(int(i) for i in layers)
        bad = [i for i in layers if not 0 <= i < self.num_layers]
        if not layers or bad:
            raise BadRequestError(f"hidden-state layer ids {list(layers)} out of range for "
                                  f"{self.model_name!r} ({self.num_layers} layers: 0..."
                                  f"{self.num_layers - 1})")
        if not self._hooked:
            for i, layer in enumerate(self.decoder_layers):
                layer.register_forward_pre_hook(self._hook(i), with_kwargs=True)
            self._hooked = True
        cache.specbus_capture = layers
        cache.specbus_hidden = None

    def _hook(self, index: int):
        """A pre-hook keeping layer `index`'s input while a capturing forward runs; a cheap
        no-op otherwise (one attribute test per layer)."""

        def hook(_module, args, kwargs):
            tap = self._tap
            if tap is not None and index in tap:
                h = args[0] if args else kwargs["hidden_states"]
                tap[index] = h  # [batch, n, hidden]; `_run` splits it per row
            return None

        return hook

    def take_hidden(self, cache: Any) -> Any:
        hidden = getattr(cache, "specbus_hidden", None)
        if hidden is not None:
            cache.specbus_hidden = None
        return hidden

    def _run(self, cache: Any, **kwargs: Any) -> Any:
        """One model call; on a capturing cache, the listed layers' inputs are kept (the
        layers' own inputs, not copies made by a second pass) as [n, layers, hidden]."""
        return self._run_rows(cache, [(cache, slice(None))], **kwargs)

    def _run_rows(self, run_cache: Any, rows: list[tuple[Any, Any]], **kwargs: Any) -> Any:
        """One model call on `run_cache`; batch row b's fed positions `rows[b][1]` belong to
        the sequence cache `rows[b][0]`, which gets its captured hidden states when it asked
        for them (each its own layers)."""
        wanted = [getattr(c, "specbus_capture", None) for c, _ in rows]
        union = sorted({i for layers in wanted if layers for i in layers})
        if not union:
            return self.model(past_key_values=run_cache, use_cache=True, **kwargs)
        self._tap = dict.fromkeys(union)
        try:
            out = self.model(past_key_values=run_cache, use_cache=True, **kwargs)
            for b, ((cache, fed), layers) in enumerate(zip(rows, wanted, strict=True)):
                if layers:
                    cache.specbus_hidden = torch.stack(
                        [self._tap[i][b, fed] for i in layers], dim=1)
        finally:
            self._tap = None
        return out

    @torch.inference_mode()
    def forward(self, cache: Any, token_ids: Sequence[int]) -> np.ndarray:
        if self.lean is not None or self._banded:
            return self._lean_one(cache, token_ids, None, last_only=False)
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        out = self._run(cache, input_ids=ids)
        return out.logits[0].float().cpu().numpy()

    @torch.inference_mode()
    def forward_last(self, cache: Any, token_ids: Sequence[int]) -> np.ndarray:
        # logits_to_keep=1 is also what HF generate uses for the prompt
        if self.lean is not None or self._banded:
            return self._lean_one(cache, token_ids, None, last_only=True)[-1]
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        out = self._run(cache, input_ids=ids, logits_to_keep=1)
        return out.logits[0, -1].float().cpu().numpy()

    @torch.inference_mode()
    def forward_tree(
        self, cache: Any, token_ids: Sequence[int], parents: Sequence[int]
    ) -> np.ndarray:
        if self.lean is not None or self._banded:
            return self._lean_one(cache, token_ids, parents, last_only=False)
        n, past = len(token_ids), self.cache_length(cache)
        depth, visible = tree_layout(parents)
        dtype = self.model.dtype
        mask = torch.zeros((1, 1, n, past + n), dtype=dtype, device=self.device)
        mask[0, 0, :, past:].masked_fill_(
            torch.from_numpy(~visible).to(self.device), torch.finfo(dtype).min
        )
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        pos = torch.from_numpy(past + depth)[None].to(self.device)
        out = self._run(cache, input_ids=ids, attention_mask=mask, position_ids=pos)
        return out.logits[0].float().cpu().numpy()

    @property
    def rows_independent(self) -> bool:
        """The quantized forward computes every row alone (`Backend.rows_independent`)."""
        return isinstance(self.lean, quant_forward.QuantForward) and self.kv_bound is None

    @torch.inference_mode()
    def forward_tree_after(self, cache: Any, prompt_rows: Sequence[int],
                           token_ids: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """One forward where the lean or quantized forward serves (the prompt rows skip the
        LM head: `torch_batch.LogitsFrom`), else `Backend`'s two."""
        if self.lean is None and not self._banded:
            return super().forward_tree_after(cache, prompt_rows, token_ids, parents)
        n = len(prompt_rows)
        ids = [*prompt_rows, *token_ids]
        tree = [n + p if p >= 0 else n - 1 for p in parents]  # the root after the last row
        feed = torch_batch.LogitsFrom(ids, [*range(-1, n - 1), *tree], n)
        return torch_batch.forward(self, [cache], [feed])[0]

    def _lean_one(self, cache: Any, token_ids: Sequence[int], parents: Sequence[int] | None,
                  last_only: bool) -> np.ndarray:
        """One sequence through the lean forward: the batch layout with one sequence in it."""
        ids = list(token_ids)
        if parents is None:
            parents = list(range(-1, len(ids) - 1))
        return torch_batch.forward(self, [cache], [(ids, list(parents))],
                                   last_only=[last_only])[0]

    @torch.inference_mode()
    def forward_batch(self, caches: Sequence[Any],
                      feeds: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[np.ndarray]:
        """Several sequences in one model call (see `torch_batch.py` for the layout); one
        sequence, or `batch_invariant`, goes through the solo code paths, bit for bit."""
        if len(caches) <= 1 or self.batch_invariant:
            return super().forward_batch(caches, feeds)
        return torch_batch.forward(self, caches, feeds)

    @torch.inference_mode()
    def compact(self, cache: Any, base: int, keep: Sequence[int]) -> None:
        keep = list(keep)
        if keep == list(range(len(keep))):
            self.crop(cache, base + len(keep))
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        for layer in cache.layers:
            if isinstance(layer, growing_cache.GrowingLayer):
                growing_cache.compact(layer, base, idx)
            else:
                idx_b = idx + base
                layer.keys = torch.cat([layer.keys[..., :base, :], layer.keys[..., idx_b, :]],
                                       dim=-2)
                layer.values = torch.cat(
                    [layer.values[..., :base, :], layer.values[..., idx_b, :]], dim=-2)

    supports_prefix_copy = True

    def copy_prefix(self, src: Any, dst: Any, length: int) -> None:
        if not 0 < length <= self.cache_length(src) or self.cache_length(dst):
            raise ValueError(f"cannot copy {length} positions of a {self.cache_length(src)}-"
                             f"position cache into one of {self.cache_length(dst)}")
        for i, layer in enumerate(src.layers):
            if isinstance(layer, growing_cache.BoundedLayer):  # its band, as it was then
                layer.copy_prefix_to(dst.layers[i], length)
                continue
            # `update` on an empty layer concatenates onto nothing: a copy, not a view
            dst.update(layer.keys[..., :length, :], layer.values[..., :length, :], i)

    def prefix_floor(self, cache: Any) -> int:
        """The fewest positions `copy_prefix` can take from `cache`: 0 (any) but under a
        bound that has dropped positions (`BoundedLayer.prefix_floor`)."""
        return max((layer.prefix_floor() for layer in cache.layers
                    if isinstance(layer, growing_cache.BoundedLayer)), default=0)

    @torch.inference_mode()
    def settle_cache(self, cache: Any, length: int) -> int:
        self.crop(cache, length)
        growing_cache.trim(cache, exact=True)
        cache.specbus_hidden = None  # captured states of its last forward: not kept
        nbytes = 0
        for layer in cache.layers:
            if layer.keys is None:
                continue
            if getattr(layer, "_drop", 0):  # bounded: its buffer is already its steady size
                nbytes += layer._keys.nbytes + layer._values.nbytes
                continue
            for name in ("keys", "values"):
                t = getattr(layer, name)
                if t.untyped_storage().nbytes() > t.nbytes or not t.is_contiguous():
                    # one copy into storage of its own size (`.contiguous()` of the slice was
                    # one copy, `.clone()` of that another, ~2 ms a kept agent cache)
                    t = t.clone(memory_format=torch.contiguous_format)
                    setattr(layer, name, t)
                nbytes += t.nbytes
        return nbytes

    def cache_length(self, cache: Any) -> int:
        return int(cache.get_seq_length())

    def crop(self, cache: Any, length: int) -> None:
        # transformers 5 wants a negative count of tokens to remove
        extra = self.cache_length(cache) - length
        if extra > 0:
            cache.crop(-extra)
        growing_cache.commit(cache)  # bounded layers: what stays is committed, overlay freed
        #: the K/V bytes of the cache cropped last (each step's end): `generate --json`'s
        #: `kv_bytes`
        self.last_kv_bytes = growing_cache.kv_bytes(cache)


def _auto_weights(ref: Any, device: str) -> str:
    """`--weights auto`: a GGUF model's own blocks where the quantized forward serves it (said
    in the log, with why not where it does not), else the fp32 reference mode."""
    if device != "cpu":
        why = f"the quantized forward runs on CPUs (this is {device})"
    elif models.shipped_gguf(ref) is None:
        why = "the model is a folder, not a GGUF file (--weights q8|q4 quantizes it)"
    else:
        why = few_rows.unavailable() or (None if few_rows.load() is not None
                                         else "the kernels did not load")
        if why is None:
            return "file"
    log.info("weights auto: fp32 (%s)", why)
    return "fp32"


def _quant_forward(model: Any, ref: Any, weights: str,
                   device: str) -> quant_forward.QuantForward:
    """The quantized forward (said in the log), or a BadRequestError saying why it cannot
    serve. q4 on the embedded model takes its shipped GGUF's blocks as they are."""
    if device != "cpu":
        raise BadRequestError(f"--weights {weights} runs on CPUs (this verifier is on {device}); "
                              "--weights fp32 serves other devices")
    # the GGUF's own blocks: asked for (file), or the embedded model's shipped Q4_1 file (q4)
    gguf = None
    if weights == "file" or (weights == "q4" and ref.name == models.DEFAULT_MODEL):
        gguf = models.shipped_gguf(ref)
    try:
        forward = quant_forward.build(model, weights, gguf)
    except quant_forward.QuantError as exc:
        raise BadRequestError(f"model {ref.name!r}: --weights {weights}: {exc}") from None
    log.info("forward: quantized %s, %.0f MB of weights (quant_forward; --weights fp32 is "
             "the reference mode)", forward.form, forward.nbytes() / 1e6)
    return forward


def _lean_forward(model: Any) -> torch_lean.LeanForward | None:
    """The lean forward for `model` where it serves (and is not switched off), else None;
    said once in the log either way."""
    if os.environ.get(FORWARD_ENV, "").strip().lower() == "transformers":
        log.info("forward: transformers' own (%s=transformers)", FORWARD_ENV)
        return None
    if not torch_lean.supported(model):
        log.info("forward: transformers' own (no lean forward for %s on this device)%s",
                 getattr(model.config, "model_type", "this model"),
                 "; sliding-window layers: band masks in torch_batch"
                 if growing_cache.windowed(model.config) else "")
        return None
    log.info("forward: lean float32 Llama forward (torch_lean)")
    return torch_lean.LeanForward(model)
