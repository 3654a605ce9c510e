"""The fused Domino head rollout behind the drafting ladder's `Rollout` signature, and when to use it.

`hf_domino.drafting_domino.eager_rollout` is the reference rollout; this module offers two faster ones built on the
kernels of `hf_domino.triton_kernels`, for greedy decoding and sampling (temperature, and top-k / top-p / min-p after
it, each row of a batch with its own settings), over the whole vocabulary or over the drafter's draft vocabulary:

- `TritonRollout`: the fused kernels, launched one by one for every block;
- `DominoHeadGraphRunner`: the same launches captured once as a CUDA graph and replayed, which removes the launch
  latency that dominates the head at 16 sequential positions per block.

Both are low-level callables `(draft_hidden, base_logits, anchor_ids, target_embed_weight, vocab) -> (draft_ids,
logits)` (`FastRollout`), configured once like `eager_rollout` (sampling settings, head on/off). `select_rollout()` is what the
candidate generator calls once per `generate()`: it picks one of them for the call's `domino_rollout=` option (or
`None` for the eager rollout) and wraps it in `FusedRollout`, a ladder `Rollout` `(BlockDraft, prefix_ids) -> Drafts`.
The choice depends only on its arguments: no environment variable changes it behind the caller's back.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from . import triton_kernels as kernels
from .drafting_domino import BlockDraft, Drafts, Rollout, picked_probability

# The graph runner captures exactly what `fused_rollout` launches.
from .triton_kernels import check_kernel_device
from .triton_launch import Sampling, Warps, Workspace
from .triton_rollout import (
    HeadWeights,
    check_vocab_ids,
    fused_rollout,
    launch_rollout,
    prepare_rollout,
    rows_sampling,
)
from .warpers_domino import SortFreeTopP

if TYPE_CHECKING:
    from transformers import LogitsProcessorList

    from .modeling_domino import DominoForSpeculation, TargetModules

# `(draft_hidden [rows, k, H], base_logits [rows, k, V'], anchor_ids [rows, n], target_embed_weight [V, H],
#  vocab [V'] | None, sampling: one `Sampling` per row | None) -> (draft_ids [rows, k], logits [rows, k, V' (greedy)
#  or V (sampling)] fp32)`: `fused_rollout`'s contract with the configuration bound (sampling `None`: the rollout's
# own settings for every row).
FastRollout = Callable[
    [torch.Tensor, torch.Tensor, torch.LongTensor, torch.Tensor, "torch.Tensor | None", "Sequence[Sampling] | None"],
    tuple[torch.LongTensor, torch.Tensor],
]

# The values of generate()'s `domino_rollout=` option.
ROLLOUT_MODES = ("auto", "eager", "triton", "triton+graph")


class TritonRollout:
    """The fused rollout without a CUDA graph, as a `FastRollout` callable.

    Args:
        drafter: the drafter whose head to run.
        sampling: `None` for greedy, else the sampling settings of every row (a call may give each row its own).
        head: correct the base logits with the Domino head (off: base-logits argmax / sampling, DFlash drafting).
        branches: a call's trees of first-token branches (`domino_branches`): rows in groups of that many copies of
            one block, each continuing from another of its likeliest first drafts (`triton_rollout.take_branches`).
    """

    def __init__(
        self,
        drafter: DominoForSpeculation,
        *,
        sampling: Sampling | None,
        head: bool = True,
        branches: int = 1,
    ):
        self.drafter = drafter
        self.sampling = sampling
        self.head = head
        self.branches = branches
        self._checked_vocab: tuple | None = None

    def _check_vocab_once(self, vocab: torch.Tensor | None, embed: torch.Tensor) -> None:
        """Checks `vocab`'s values (`check_vocab_ids`): it costs a device synchronization, so once per vocabulary
        tensor (and in-place version), not once per block."""
        if vocab is None:
            return
        key = (vocab.data_ptr(), vocab.numel(), vocab._version, vocab.device, embed.shape[0])
        if key != self._checked_vocab:
            check_vocab_ids(vocab, min(self.drafter.config.vocab_size, embed.shape[0]))
            self._checked_vocab = key

    def settings_for(self, rows: int, sampling: Sequence[Sampling] | None) -> tuple[Sampling, ...] | None:
        """Each row's settings for a call: its own (`sampling`) or the rollout's; `None` when greedy."""
        if self.sampling is None:
            return None
        return rows_sampling(self.sampling if sampling is None else sampling, rows)

    def __call__(
        self,
        draft_hidden: torch.Tensor,
        base_logits: torch.Tensor,
        anchor_ids: torch.LongTensor,
        target_embed_weight: torch.Tensor,
        vocab: torch.Tensor | None = None,
        sampling: Sequence[Sampling] | None = None,
    ) -> tuple[torch.LongTensor, torch.Tensor]:
        self._check_vocab_once(vocab, target_embed_weight)
        return fused_rollout(
            self.drafter,
            draft_hidden,
            base_logits,
            anchor_ids,
            target_embed_weight,
            head=self.head,
            pure_draft_prefix_len=self.drafter.config.pure_draft_prefix_len,
            sampling=self.settings_for(base_logits.shape[0], sampling),
            vocab=vocab,
            check_vocab=False,
            branches=self.branches,
        )


class DominoHeadGraphRunner(TritonRollout):
    """Captures a whole block rollout as one CUDA graph and replays it, as a `FastRollout` callable.

    A `TritonRollout` that records its launches once: without a usable graph (capture failed, with
    `fallback_on_capture_error`) it is exactly that `TritonRollout`.

    Head on/off and greedy/sampling are fixed at construction. The graph is captured on the first call for the
    call's configuration: vocabulary size, the draft vocabulary (none, or the address and size of its id tensor),
    dtypes, device, prefix length, and the address and layout of every weight and of the embedding table, and for
    its number of rows (sequences drafted together) and of drafts. A call with any of the configuration changed drops
    the graph (after the device has finished with it) and captures a new one, as does a call with more rows or
    drafts than captured. A call with fewer replays the captured graph and keeps the leading rows and positions,
    which is exact because rows are independent and a draft position never depends on later ones (blocks shrink
    near `max_length` and a batch's rows retire as they finish; re-capturing there would cost more than the few
    wasted positions). A runner told the call's most drafts per block (`capture_drafts`) captures room for them from
    its first block: a call's blocks then replay one graph, and the kernels compile for one shape (Triton specializes
    an integer argument that is 1 or a multiple of 16, so a block of 16 drafts after one of 12 compiled anew, 0.3-1 s
    each on the third GPU run). Weights updated in place are picked up without
    re-capture: the graph reads them by address. Each row's sampling settings and the sampling seed live in device
    buffers, so neither forces a re-capture: top-k / top-p / min-p are torch ops over the workspace's logits and each
    row's settings (`warp_rows`), captured with the kernels for the warpers some row had; a call whose rows ask for
    one not captured (or a wider top-k) captures again, with those of both.

    Outputs are copied out of the static buffers, so a result stays valid after the next call.

    Args:
        drafter: the drafter whose head to run.
        sampling: `None` for greedy, else the sampling settings of rows a call gives none.
        head: correct the base logits with the Domino head.
        fallback_on_capture_error: when capture fails (e.g. inside another capture), warn once and run the fused
            kernels without a graph from then on, instead of raising.
        capture_drafts: the drafts per block a capture makes room for at least (the call's cap; 0: the block's own).
    """

    def __init__(
        self,
        drafter: DominoForSpeculation,
        *,
        sampling: Sampling | None,
        head: bool = True,
        fallback_on_capture_error: bool = False,
        capture_drafts: int = 0,
        branches: int = 1,
    ):
        super().__init__(drafter, sampling=sampling, head=head, branches=branches)
        self.fallback_on_capture_error = fallback_on_capture_error
        self.capture_drafts = capture_drafts
        self.num_captures = 0
        self._key: tuple | None = None
        self._size: tuple[int, int] = (0, 0)  # (rows, drafts) captured
        self._warps = Warps()  # the warpers captured
        self._graph: torch.cuda.CUDAGraph | None = None
        self._capture_failed = False

    @property
    def captured_num_drafts(self) -> int | None:
        return None if self._key is None else self._size[1]

    def reset(self) -> None:
        """Drops the captured graph and its buffers (waiting for the device to be done with them first)."""
        if self._graph is not None:
            torch.cuda.synchronize(self._device)
        self._graph, self._key, self._size, self._warps = None, None, (0, 0), Warps()

    def _config_key(
        self,
        weights: HeadWeights | None,
        draft_hidden: torch.Tensor,
        base_logits: torch.Tensor,
        embed: torch.Tensor,
        vocab: torch.Tensor | None,
    ) -> tuple:
        return (
            base_logits.shape[2],
            base_logits.dtype,
            draft_hidden.dtype,
            base_logits.device,
            self.drafter.config.pure_draft_prefix_len,
            self.sampling is not None,
            None if weights is None else weights.signature(),  # also tells head on from head off
            (embed.data_ptr(), embed.dtype, embed.device, tuple(embed.shape), embed.stride()),
            # The graph reads the ids by address; values changed in place are checked again (`_version`).
            None if vocab is None else (vocab.data_ptr(), vocab.numel(), vocab.device, vocab._version),
            self.drafter.config.vocab_size,  # the width of sampled (spread) logits
        )

    @torch.no_grad()
    def __call__(
        self,
        draft_hidden: torch.Tensor,
        base_logits: torch.Tensor,
        anchor_ids: torch.LongTensor,
        target_embed_weight: torch.Tensor,
        vocab: torch.Tensor | None = None,
        sampling: Sequence[Sampling] | None = None,
    ) -> tuple[torch.LongTensor, torch.Tensor]:
        if self._capture_failed:
            return super().__call__(draft_hidden, base_logits, anchor_ids, target_embed_weight, vocab, sampling)
        weights, device = prepare_rollout(
            self.drafter, self.head, draft_hidden, base_logits, target_embed_weight, vocab, anchor_ids
        )
        if device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need CUDA tensors; the Domino head is on {device}.")
        draft_hidden, base_logits = draft_hidden.to(device), base_logits.to(device)
        vocab = None if vocab is None else vocab.to(device)
        rows, num_drafts = base_logits.shape[:2]
        sampling = self.settings_for(rows, sampling)
        warps = Warps.of(sampling or ())
        key = self._config_key(weights, draft_hidden, base_logits, target_embed_weight, vocab)
        # Same configuration, with as many rows and drafts or fewer and no warper the graph lacks: replay.
        if key != self._key or rows > self._size[0] or num_drafts > self._size[1] or not self._warps.covers(warps):
            size = (rows, max(num_drafts, self.capture_drafts))
            # Grow, never shrink: the next call may have the rows, drafts or warpers this one lacks.
            if key == self._key:
                size = (max(size[0], self._size[0]), max(size[1], self._size[1]))
                warps = warps.union(self._warps)
            self.reset()
            try:
                self._check_vocab_once(vocab, target_embed_weight)
                self._capture(key, size, warps, weights, draft_hidden, base_logits, target_embed_weight, vocab)
            except Exception as error:  # noqa: BLE001 - re-raised unless the caller asked for the fallback
                self.reset()
                if not self.fallback_on_capture_error:
                    raise
                warnings.warn(
                    f"Capturing the Domino head as a CUDA graph failed ({error!r}); using the fused kernels without "
                    "a graph from now on.",
                    stacklevel=2,
                )
                self._capture_failed = True
                return super().__call__(draft_hidden, base_logits, anchor_ids, target_embed_weight, vocab, sampling)

        self._draft_hidden[:rows, :num_drafts].copy_(draft_hidden)
        self._base_logits[:rows, :num_drafts].copy_(base_logits)
        self._workspace.start(anchor_ids, sampling)
        self._graph.replay()
        draft_ids = self._workspace.tokens[:rows, 1 : num_drafts + 1].to(anchor_ids.device, copy=True)
        return draft_ids, self._workspace.logits[:rows, :num_drafts].clone()

    def _capture(
        self,
        key: tuple,
        size: tuple[int, int],
        warps: Warps,
        weights: HeadWeights | None,
        draft_hidden: torch.Tensor,
        base_logits: torch.Tensor,
        embed_weight: torch.Tensor,
        vocab: torch.Tensor | None,
    ) -> None:
        check_kernel_device(base_logits.device)
        self._device = base_logits.device
        (rows, num_drafts), vocab_size = size, base_logits.shape[2]
        sample = self.sampling is not None
        self._workspace = Workspace(
            num_drafts, vocab_size, self._device, weights, vocab=vocab,
            spread_size=self.drafter.config.vocab_size if sample else None, warps=warps, rows=rows,
        )  # fmt: skip
        # Static inputs of the captured size, this call's block in their leading rows and positions (zeros beyond:
        # rows and positions the graph computes but no call reads).
        self._draft_hidden = draft_hidden.new_zeros(rows, num_drafts, draft_hidden.shape[2])
        self._base_logits = base_logits.new_zeros(rows, num_drafts, vocab_size)
        self._draft_hidden[: draft_hidden.shape[0], : draft_hidden.shape[1]].copy_(draft_hidden)
        self._base_logits[: base_logits.shape[0], : base_logits.shape[1]].copy_(base_logits)
        prefix_len = self.drafter.config.pure_draft_prefix_len

        def launch() -> None:
            launch_rollout(
                weights,
                self._draft_hidden,
                self._base_logits,
                embed_weight,
                self._workspace,
                prefix_len=prefix_len,
                sample=sample,
                branches=self.branches,
            )

        # Warm up on a side stream (as torch.cuda.graphs recommends): compiles the Triton kernels and settles the
        # allocator, neither of which may happen during capture.
        with torch.cuda.device(self._device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                launch()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                launch()
        self._graph, self._key, self._size, self._warps = graph, key, size, warps
        self.num_captures += 1


class FusedRollout:
    """A `FastRollout` behind the ladder's `Rollout` signature: `(BlockDraft, prefix_ids) -> Drafts`.

    The embedding table is read from `target` on every call (not once), so a target moved or re-tied after
    `select_rollout()` is still the one gathered from. A block drafted over a draft vocabulary (`block.vocab`) comes
    back as `eager_rollout` returns it: token ids, and greedy logits over the vocabulary's columns or sampled logits
    over the whole vocabulary. The batch loop calls `draft_rows` with all its rows at once.
    """

    def __init__(self, fused: FastRollout, target: TargetModules):
        self.fused = fused
        self.target = target

    def __call__(self, block: BlockDraft, prefix_ids: torch.LongTensor) -> Drafts:
        ids, logits, confidence = self.draft_rows(block.hidden, block.base_logits, block.vocab, prefix_ids)
        return Drafts(ids, logits, confidence[0])

    def draft_rows(
        self,
        hidden: torch.Tensor,
        base_logits: torch.Tensor,
        vocab: torch.Tensor | None,
        anchor_ids: torch.LongTensor,
        processors: Sequence[LogitsProcessorList] | None = None,
    ) -> tuple[torch.LongTensor, torch.Tensor, torch.Tensor]:
        """One block for each of `rows` sequences (`hidden [rows, k, H]`, `base_logits [rows, k, V']`, each row's
        anchor the last column of `anchor_ids`): `(draft ids [rows, k], logits, confidence [rows, k])`, the
        confidence being each draft's probability under the logits it was picked from.

        `processors`: when sampling, each row's logits processors, for rows that sample with settings of their own
        (a server's requests): each row's drafts are drawn under its own (`draws_under` must have said the fused
        head can); `None`: every row under the call's."""
        sampling = None
        if processors is not None and self.fused.sampling is not None:
            sampling = [row_sampling(row) for row in processors]
        ids, logits = self.fused(hidden, base_logits, anchor_ids, self.target.embed_tokens.weight, vocab, sampling)
        index = ids.to(logits.device).contiguous()
        if vocab is not None and logits.shape[-1] == base_logits.shape[-1]:
            # Greedy logits are over the vocabulary's columns: the column of each id (the vocabulary is sorted).
            index = torch.searchsorted(vocab.to(logits.device), index)
        return ids, logits, picked_probability(logits, index)

    def draws_under(self, processors: Sequence[LogitsProcessorList]) -> bool:
        """Whether `draft_rows` can draw rows under these processors, one list per row (a greedy call's rows: always;
        sampled rows: where each row's processors are what `fused_sampling` runs fused)."""
        return self.fused.sampling is None or all(row_sampling(row) is not None for row in processors)


# ----------------------------------------------------------------------------------------------------------- dispatch
# Why a call's logits processors keep the head eager.
OTHER_PROCESSORS = (
    "logits processors other than a temperature followed by top-k, top-p and min-p as generate() builds them "
    "(penalties, greedy-decoding processors, warpers in another order, ...) only run on the eager path"
)


def fused_sampling(
    logits_processor: LogitsProcessorList | None, do_sample: bool
) -> tuple[Sampling | None, str | None]:
    """How the fused head draws under a call's (or one row's) logits processors: `(None, None)` when decoding
    greedily, `(Sampling, None)` when sampling, `(None, why)` where only the eager head can.

    The fused path runs what a plain sampling call holds: a temperature (1.0 without one), then any of top-k, top-p
    and min-p in the order generate() builds them, each as generate() builds it (filtering to -inf; top-p and min-p
    keeping one token at least). They read the scores alone, so a captured graph applies them, over each row's own
    values (`Sampling`). Anything else (penalties, which read the sequence; a temperature after another warper;
    warpers in another order; any processor when decoding greedily) is left to the eager path.
    """
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    processors = list(logits_processor or ())
    temperature = 1.0
    if processors and isinstance(processors[0], TemperatureLogitsWarper):
        temperature = float(processors.pop(0).temperature)
    if not do_sample:  # greedy decoding ignores a temperature; other processors change the argmax
        return None, (OTHER_PROCESSORS if processors else None)
    if not temperature > 0:
        return None, f"temperature must be positive, got {temperature}"
    fields = {TopKLogitsWarper: "top_k", TopPLogitsWarper: "top_p", SortFreeTopP: "top_p", MinPLogitsWarper: "min_p"}
    names = [fields.get(type(processor)) for processor in processors]
    if None in names or names != sorted(set(names), key=["top_k", "top_p", "min_p"].index):  # others, another order
        return None, OTHER_PROCESSORS
    as_built = all(
        processor.filter_value == float("-inf") and (name == "top_k" or processor.min_tokens_to_keep == 1)
        for name, processor in zip(names, processors)
    )
    if not as_built:
        return None, OTHER_PROCESSORS
    values = {name: getattr(processor, name) for name, processor in zip(names, processors)}
    top_k, top_p, min_p = int(values.get("top_k", 0)), float(values.get("top_p", 1.0)), float(values.get("min_p", 0.0))
    return Sampling(temperature, top_k, top_p, min_p), None


def row_sampling(processors: LogitsProcessorList) -> Sampling | None:
    """A sampled row's settings (`fused_sampling`; `None`: only the eager head draws under its processors), kept on
    its processor list, which the row holds for its life: read at every block it drafts."""
    if not hasattr(processors, "fused_sampling"):
        processors.fused_sampling = fused_sampling(processors, do_sample=True)[0]
    return processors.fused_sampling


def select_rollout(
    drafter: DominoForSpeculation,
    target: TargetModules,
    *,
    do_sample: bool,
    logits_processor: LogitsProcessorList | None,
    mode: str = "auto",
    max_drafts: int = 0,
    branches: int = 1,
) -> Rollout | None:
    """Chooses how a `generate()` call rolls the Domino head out: a fused ladder `Rollout`, or `None` for eager.

    The candidate generator calls this only with the head on (the case the kernels fuse), with or without a draft
    vocabulary: the returned rollout reads it from each block (`BlockDraft.vocab`).

    Args:
        drafter: the drafter.
        target: the target's embedding table and LM head; the kernels gather token embeddings from the table.
        do_sample: sampling (`True`) or greedy decoding.
        logits_processor: the call's logits processors; runs fused: none, or a temperature (ignored for greedy
            decoding), and when sampling top-k / top-p / min-p after it (`fused_sampling`).
        mode: generate()'s `domino_rollout=` option: `"auto"` (fused kernels + CUDA graph when the drafter is on
            CUDA, Triton imports and nothing above rules it out, else `None`), `"eager"` (`None`), `"triton"` (fused
            kernels, no graph) or `"triton+graph"`. The forced modes raise, saying why, when they cannot run rather
            than falling back.
        max_drafts: the call's most drafts per block, which a CUDA graph captures room for from its first block
            (`DominoHeadGraphRunner`'s `capture_drafts`; 0: each capture sized by its block).
        branches: the call's first-token branches per block (`domino_branches`; `draft_rows` then takes each row's
            block repeated that many times in a row).

    Returns:
        A `FusedRollout` (`(block, prefix_ids) -> Drafts`) wrapping a `DominoHeadGraphRunner` or a `TritonRollout`,
        or `None` when the eager rollout should run.
    """
    if mode not in ROLLOUT_MODES:
        raise ValueError(f"mode must be one of {ROLLOUT_MODES}, got {mode!r}.")
    if mode == "eager":
        return None
    forced = mode != "auto"
    sampling, reason = fused_sampling(logits_processor, do_sample)
    reason = reason or _unsupported_reason(drafter, target.embed_tokens.weight)
    if reason is None and not forced and drafter.device.type != "cuda":
        reason = f"the drafter is on {drafter.device}, not CUDA"
    if reason is not None:
        if forced:
            raise ValueError(f"domino_rollout={mode!r} cannot run here: {reason}. Use 'auto' or 'eager'.")
        return None

    if mode == "auto":
        fused = DominoHeadGraphRunner(
            drafter,
            sampling=sampling,
            fallback_on_capture_error=True,
            capture_drafts=max_drafts,
            branches=branches,
        )
    elif mode == "triton+graph" and drafter.device.type != "cuda":
        raise RuntimeError(
            f"domino_rollout='triton+graph' needs CUDA (CUDA graphs), and the drafter is on {drafter.device}: use "
            "domino_rollout='eager' there ('triton' runs on a CPU only under Triton's interpreter, for tests)."
        )
    elif drafter.device.type != "cuda" and not kernels.kernels_interpreted():
        raise RuntimeError(
            f"domino_rollout={mode!r} on {drafter.device} needs Triton's interpreter: set TRITON_INTERPRET=1 before "
            "importing hf_domino.triton_kernels (slow; meant for tests). Use domino_rollout='eager' on CPU."
        )
    elif mode == "triton+graph":
        fused = DominoHeadGraphRunner(drafter, sampling=sampling, capture_drafts=max_drafts, branches=branches)
    else:
        fused = TritonRollout(drafter, sampling=sampling, branches=branches)
    return FusedRollout(fused, target)


def _unsupported_reason(drafter: DominoForSpeculation, embed_weight: torch.Tensor) -> str | None:
    if kernels.triton is None:
        return "Triton is not installed"
    if drafter.config.has_domino_head:
        weights = HeadWeights.of(drafter)
        devices = {w.device for w in vars(weights).values()}
        if len(devices) != 1 or next(iter(devices)).type == "meta":
            return f"the head's weights are spread over {sorted(map(str, devices))}"
        if embed_weight.device not in devices:
            return f"the target's embedding table is on {embed_weight.device}, the head on {next(iter(devices))}"
    return None


__all__ = [
    "ROLLOUT_MODES",
    "DominoHeadGraphRunner",
    "FastRollout",
    "FusedRollout",
    "TritonRollout",
    "fused_sampling",
    "row_sampling",
    "select_rollout",
]
