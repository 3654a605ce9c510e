"""The draft step, written once: one block of Domino drafting as a ladder of small functions.

    context features --(DrafterContext.append)--> draft_block --> rollout (eager or fused) --> pick, per position

- `DrafterContext` holds what the drafter knows of the verified sequence: the keys/values of the context tokens it
  has already read, and the target features of verified tokens it has not read yet (`pending`). Skipped blocks
  (a plain target step, k = 0) only append to `pending`, so drafting can resume at any step.
- `draft_block` runs the parallel backbone over `[pending context ; anchor, MASK, ...]` and the target's LM head on
  the first `num_drafts` draft positions only, over the drafter's draft vocabulary when it has one.
- a `Rollout` turns a `BlockDraft` into drafts: `eager_rollout` (the reference; the Domino head's GRU and logit
  correction, then `pick`, position by position) or the fused Triton/CUDA-graph rollout of `hf_domino.fused_head`,
  with the same call signature.
- a `Pick` chooses one token from one position's logits: argmax, or a draw from the processed distribution.
- Copied drafts, the other source, are `copied_drafts_domino`'s (prompt lookup and the datastore).

The candidate generator (`generation_domino`), the benchmark's hand-written loop and the tests all call this ladder.
This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

from .cache_domino import buffer_layers
from .warpers_domino import SortFreeTopP

if TYPE_CHECKING:
    from transformers import GenerationConfig, LogitsProcessorList

    from .modeling_domino import DominoForSpeculation, TargetModules
    from .options_domino import DominoOptions


@dataclass
class DrafterContext:
    """The drafter's view of the verified tokens before the anchor.

    `cache` holds the drafter keys/values of the first `length` of them; `pending` the target features
    `[1, n_i, len(target_layer_ids) * hidden]` of the next ones, in pieces, which the next `draft_block` reads and
    caches.
    """

    cache: DynamicCache = field(default_factory=lambda: buffer_layers(DynamicCache()))
    length: int = 0
    pending: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Verified tokens before the anchor, read or pending: the anchor's position."""
        return self.length + sum(piece.shape[1] for piece in self.pending)

    def append(self, features: torch.Tensor) -> None:
        """Adds the features of newly verified tokens. Kept in pieces, joined when the drafter next runs: joining at
        every step would copy the whole backlog (the prompt's features included) once per skipped block."""
        self.pending.append(features)


@dataclass
class BlockDraft:
    """The parallel part of one block: backbone outputs and base logits of the positions to draft.

    `base_logits` cover `vocab` (token ids, `[V']`) when the drafter has a draft vocabulary, else the whole
    vocabulary (`vocab` is None); position i of a logits row is token `vocab[i]`.
    """

    hidden: torch.Tensor  # [1, k, hidden]
    base_logits: torch.Tensor  # [1, k, V'] float32
    vocab: torch.Tensor | None = None

    @classmethod
    def from_hidden(cls, hidden: torch.Tensor, target: TargetModules, vocab: torch.Tensor | None = None) -> BlockDraft:
        return cls(hidden=hidden, base_logits=target.logits(hidden, vocab).float(), vocab=vocab)

    @property
    def num_drafts(self) -> int:
        return self.base_logits.shape[1]


@dataclass
class Drafts:
    """What a rollout chose: token ids, the exact (processed) logits each was picked from, and its probability."""

    ids: torch.LongTensor  # [1, k]
    logits: torch.Tensor  # [1, k, V'] (V' = the full vocabulary whenever logits processors or sampling ran)
    confidence: torch.Tensor  # [k] float32: probability of each draft under the distribution it was picked from

    def __len__(self) -> int:
        return self.ids.shape[1]

    def keep(self, k: int) -> Drafts:
        """The first `k` drafts (a draft never depends on later ones, so this is exact)."""
        return Drafts(self.ids[:, :k], self.logits[:, :k], self.confidence[:k])


# (logits [1, V'], tokens realised so far [1, n]) -> (index into the logits' last axis [1, 1], processed logits)
Pick = Callable[[torch.Tensor, torch.LongTensor], tuple[torch.LongTensor, torch.Tensor]]
# (block, tokens realised before the first draft [1, n]; the last one is the anchor) -> drafts
Rollout = Callable[[BlockDraft, torch.LongTensor], Drafts]
# (confidence of the drafts rolled out so far [j]) -> whether to roll out the next one (see AdaptivePolicy.keep_rolling)
KeepRolling = Callable[[torch.Tensor], bool]


class RowsRollout(Protocol):
    """A `Rollout` that also drafts a batch's rows at once (`hf_domino.fused_head.FusedRollout`): `draft_rows(hidden
    [rows, k, H], base_logits [rows, k, V'], vocab, anchor_ids [rows, n], processors)` returns `(draft ids [rows, k],
    the logits they were picked from, each draft's probability [rows, k])`, sampled rows each drawn under its own
    logits processors (`processors`, one list per row; `None`: the call's), which `draws_under` says it can."""

    def __call__(self, block: BlockDraft, prefix_ids: torch.LongTensor) -> Drafts: ...

    def draft_rows(
        self,
        hidden: torch.Tensor,
        base_logits: torch.Tensor,
        vocab: torch.Tensor | None,
        anchor_ids: torch.LongTensor,
        processors: list[LogitsProcessorList] | None = None,
    ) -> tuple[torch.LongTensor, torch.Tensor, torch.Tensor]: ...

    def draws_under(self, processors: list[LogitsProcessorList]) -> bool: ...


def greedy_pick(logits: torch.Tensor, realised_ids: torch.LongTensor) -> tuple[torch.LongTensor, torch.Tensor]:
    return logits.argmax(dim=-1, keepdim=True), logits


def run_backbone(
    drafter: DominoForSpeculation,
    target: TargetModules,
    anchor_ids: torch.LongTensor,
    context: DrafterContext,
    num_drafts: int,
) -> torch.Tensor:
    """The parallel backbone over `[pending context ; anchor, MASK, ...]`: outputs of the first `num_drafts` drafts.

    The backbone always reads the whole block it was trained on, but its last layer computes only the positions asked
    for. The context's pending features move into its cache.
    """
    device = drafter.device
    pending = (
        torch.cat([piece.to(device) for piece in context.pending], dim=1)
        if context.pending
        else torch.zeros(1, 0, drafter.config.context_size, dtype=drafter.dtype, device=device)
    )
    anchor_position = context.num_tokens
    position_ids = torch.arange(context.length, anchor_position + drafter.config.block_size, device=device)[None]
    block_hidden = drafter(
        drafter.embed_block(target, anchor_ids),
        pending,
        position_ids,
        past_key_values=context.cache,
        num_outputs=drafter.outputs_for_drafts(num_drafts),
    )
    context.length, context.pending = anchor_position, []
    return drafter.draft_hidden_states(block_hidden)[:, :num_drafts]


def draft_block(
    drafter: DominoForSpeculation,
    target: TargetModules,
    anchor_ids: torch.LongTensor,
    context: DrafterContext,
    num_drafts: int,
    vocab: torch.Tensor | None = None,
) -> BlockDraft:
    """`run_backbone`, then the target's LM head on the drafted positions only (over `vocab` when given).

    The LM head is the costly part of drafting on a large vocabulary, hence only the `num_drafts` positions that will
    be rolled out, and only the draft vocabulary's rows.
    """
    hidden = run_backbone(drafter, target, anchor_ids, context, num_drafts)
    return BlockDraft.from_hidden(hidden, target, vocab)


def picked_probability(logits: torch.Tensor, index: torch.LongTensor) -> torch.Tensor:
    """Probability of each picked entry under `softmax(logits)` over the last axis: `[..., V']`, `[...]` -> `[...]`."""
    return logits.float().log_softmax(dim=-1).gather(-1, index[..., None])[..., 0].exp()


def draft_confidence(logits: torch.Tensor, index: torch.LongTensor) -> torch.Tensor:
    """Probability of each draft of one block under its logits: `[1, k, V']`, `[1, k]` -> `[k]`."""
    return picked_probability(logits, index)[0]


def branch_columns(logits: torch.Tensor, branches: int) -> torch.LongTensor:
    """A tree's first drafts, for rows in groups of `branches` copies of one block (`logits [rows, V']`): the i-th
    row of a group takes the group's i-th likeliest column (0: the likeliest). Device ops only, no round trip."""
    likeliest = logits.topk(branches, dim=-1).indices.view(-1, branches, branches)
    return likeliest.diagonal(dim1=1, dim2=2).reshape(-1)


def to_vocab_ids(index: torch.LongTensor, vocab: torch.Tensor | None) -> torch.LongTensor:
    """Token ids of positions in a logits row over `vocab` (identity for the full vocabulary)."""
    return index if vocab is None else vocab.to(index.device)[index]


def eager_rollout(
    drafter: DominoForSpeculation,
    target: TargetModules,
    pick: Pick = greedy_pick,
    head: bool = True,
    keep_rolling: KeepRolling | None = None,
    ends: torch.Tensor | None = None,
) -> Rollout:
    """The reference rollout: per draft position, the Domino head's correction (when `head`), then `pick`.

    The GRU reads the realised tokens of the block (the anchor, then each draft as it is chosen) from the target's
    embedding table; the first `pure_draft_prefix_len` drafts use the base logits alone. With `head=False` (or a
    DFlash drafter) every draft uses its base logits alone, and greedy picking is one vectorized argmax.
    `keep_rolling`, when given, is asked before each sequential draft after the first; a block it stops is exactly
    the first drafts of the whole block. With `ends` (the EOS token ids) a block also ends at an EOS draft
    (`stop_free_length` offers nothing after one).
    """
    config = drafter.config
    use_head = head and config.has_domino_head

    def rollout(block: BlockDraft, prefix_ids: torch.LongTensor) -> Drafts:
        if not use_head and pick is greedy_pick:  # nothing sequential left: vectorize
            index = block.base_logits.argmax(dim=-1)
            return Drafts(
                to_vocab_ids(index, block.vocab), block.base_logits, draft_confidence(block.base_logits, index)
            )
        realised, indices, chosen_logits, confidence, state = prefix_ids, [], [], [], None
        block_ends = None if ends is None else ends.to(prefix_ids.device)
        for i in range(block.num_drafts):
            if keep_rolling is not None and i and not keep_rolling(torch.cat(confidence)):
                break  # a draft never depends on later ones: the block is exact up to here
            if block_ends is not None and i and bool(torch.isin(realised[:, -1], block_ends).all()):
                break
            logits = block.base_logits[:, i]
            if use_head and i >= config.pure_draft_prefix_len:
                # The GRU reads the block's realised tokens: the anchor and any drafts on its first step, then the
                # one draft chosen since.
                unread = realised[:, prefix_ids.shape[1] - 1 :] if state is None else realised[:, -1:]
                gru_weight = drafter.prefix_gru.weight_ih_l0
                state = drafter.gru_step(target.embed(unread, gru_weight.dtype, gru_weight.device), state)
                correction = drafter.logit_correction(block.hidden[:, i : i + 1], state, block.vocab)[:, 0]
                logits = logits + correction.to(device=logits.device, dtype=logits.dtype)
            index, logits = pick(logits, realised)
            indices.append(index)
            chosen_logits.append(logits)
            if keep_rolling is not None:
                confidence.append(draft_confidence(logits[:, None], index))
            token = index if logits.shape[-1] != block.base_logits.shape[-1] else to_vocab_ids(index, block.vocab)
            realised = torch.cat([realised, token.to(realised.device)], dim=-1)
        index, logits = torch.cat(indices, dim=-1), torch.stack(chosen_logits, dim=1)
        # With keep_rolling each draft's confidence was already computed, position by position.
        confidence = torch.cat(confidence) if keep_rolling is not None else draft_confidence(logits, index)
        return Drafts(realised[:, prefix_ids.shape[1] :], logits, confidence)

    return rollout


def select_fused_rollout(
    drafter: DominoForSpeculation,
    target: TargetModules,
    options: DominoOptions,
    *,
    do_sample: bool,
    logits_processor: LogitsProcessorList | None,
    max_drafts: int = 0,
) -> RowsRollout | None:
    """The fused Triton/CUDA-graph head rollout for a `generate()` call (`hf_domino.fused_head.FusedRollout`: a
    ladder `Rollout`, and `draft_rows` for a batch), or `None` where the eager one runs.

    `options.domino_rollout` decides (`fused_head.select_rollout`); the fused rollout needs the Domino head on.
    `auto` fuses on CUDA only, so elsewhere nothing is imported. The fused head lives in the package alone (it needs
    Triton): a drafter folder's remote code uses it only where the installed `hf_domino` is the same code
    (`_installed_fused_head`), and otherwise drafts with its own eager rollout.
    """
    mode = options.domino_rollout
    if mode == "eager" or not options.head_enabled(drafter):
        if mode in ("triton", "triton+graph"):
            raise ValueError(
                f"domino_rollout={mode!r} fuses the Domino head: it needs the head on (domino_head=True, a drafter "
                "with a head); use 'auto' or 'eager' without it."
            )
        return None
    if mode == "auto" and drafter.device.type != "cuda":
        return None
    fused_head, why_not = _installed_fused_head()
    if fused_head is None:
        if mode != "auto":
            raise ImportError(f"domino_rollout={mode!r} runs hf_domino's fused head, and {why_not}.")
        return None
    return fused_head.select_rollout(
        drafter, target, do_sample=do_sample, logits_processor=logits_processor, mode=mode, max_drafts=max_drafts,
        branches=options.domino_branches,
    )  # fmt: skip


@functools.cache  # once per process and copy of this code: it reads every file of both
def _installed_fused_head() -> tuple[object | None, str]:
    """`hf_domino.fused_head` for this copy of the drafting code, or `None` and why not.

    The package's own code imports it. A drafter folder's remote code (a copy of these files under
    `transformers_modules`) calls into it only where the installed package holds the very same files: the fused head
    takes this code's blocks and options, and another release's would take other ones (a `TypeError` mid-call, or
    worse, drafts that no longer match this code's).
    """
    here = Path(__file__).parent
    spec = importlib.util.find_spec("hf_domino")
    if spec is None or not spec.submodule_search_locations:
        return None, "hf_domino is not installed (pip install hf-domino)"
    installed = Path(next(iter(spec.submodule_search_locations)))
    if __name__.rpartition(".")[0] != "hf_domino":
        differing = [
            path.name
            for path in sorted(here.glob("*.py"))
            if path.name != "__init__.py"
            and not ((installed / path.name).is_file() and (installed / path.name).read_bytes() == path.read_bytes())
        ]
        if differing:
            return None, (
                f"this drafter's remote code ({here}) is not the installed hf_domino's ({installed}; "
                f"{', '.join(differing[:3])}{', ...' if len(differing) > 3 else ''} differ): load the drafter with "
                "hf_domino.DominoForSpeculation.from_pretrained(path) to draft with the package's code, or install the "
                "hf-domino release that wrote the folder"
            )
    try:
        return importlib.import_module("hf_domino.fused_head"), ""
    except ImportError as error:
        return None, f"it cannot be imported here ({error})"


@dataclass(frozen=True)
class CallStops:
    """Where a call's sequences end, as the stopping criteria its loop asks say: at a token of `ends` (the EOS ids),
    at `max_length` tokens, or where one of the other `criteria` (stop strings, a user's own) fires.

    Read off the criteria rather than the generation config: generate() lets a user's `EosTokenCriteria` or
    `MaxLengthCriteria` (`stopping_criteria=`) take the place of the one it builds, and the target alone then stops
    where the user's says. A block cuts at the first two itself (it offers nothing after an EOS nor past
    `max_length`); only transformers' own two classes are read so, and every other criterion, a subclass of them
    included, is asked at each draft (`stop_free_length`).
    """

    ends: torch.Tensor | None
    max_length: int
    criteria: list

    @classmethod
    def of(
        cls, stopping_criteria: list | None, generation_config: GenerationConfig, device: torch.device
    ) -> CallStops:
        if stopping_criteria is None:  # a candidate generator built outside generate(): its config's
            return cls(getattr(generation_config, "_eos_token_tensor", None), generation_config.max_length, [])
        ends = [c.eos_token_id.flatten().to(device) for c in stopping_criteria if type(c) is EosTokenCriteria]
        lengths = [c.max_length for c in stopping_criteria if type(c) is MaxLengthCriteria]
        return cls(
            torch.cat(ends) if ends else None,
            min(lengths, default=generation_config.max_length),
            within_block(stopping_criteria),
        )


def reads_the_tokens(criteria: list) -> bool:
    """Whether any of these stopping criteria decides from the tokens (every one but transformers' time limit): a
    block that withholds a drawn draft for such a criterion's sake reads the draft (`stop_free_length`)."""
    return any(type(criterion) is not MaxTimeCriteria for criterion in criteria)


def within_block(criteria: list) -> list:
    """The stopping criteria a block must ask at each draft: all but transformers' own EOS and max_length criteria,
    which the block cuts at itself (`CallStops`)."""
    return [c for c in criteria if type(c) not in (EosTokenCriteria, MaxLengthCriteria)]


def stop_free_length(
    criteria,
    sequence: torch.LongTensor,
    drafts: torch.LongTensor,
    limit: int | None = None,
    ends: torch.Tensor | None = None,
    through_stop: bool = False,
) -> int:
    """How many of the first `limit` (default: all) of `drafts` `[k]` a block offers after `sequence` `[n]`: none after
    an end-of-sequence draft (`ends`: the EOS token ids), and none past the point where one of the stopping `criteria`
    (those a block must ask at each draft: stop strings, a user's own; not EOS or max_length) would fire.

    transformers' loop checks stopping criteria once per cycle, after the whole accepted block, and keeps the block
    whole. For it, if the sequence plus drafts[:j] completes a stop, only drafts[:j - 1] are offered: the target's own
    next token then decides whether the stop happens, exactly as without a drafter, and nothing is generated past it.
    That choice reads draft j itself, which is exact where drafts follow from the text alone (greedy drafts, copies)
    but not for drafts drawn at random: speculative sampling keeps the target's law only where whether draft j is
    offered does not depend on draft j. So a loop that cuts an accepted block where a criterion fires (the batch
    loop, `first_stop`) offers drafts[:j] (`through_stop`), as it offers an EOS draft; the drafts after either are
    not offered: nothing after them is ever generated, and logits processors would read sequences that go on past
    their end, which the target alone never shows them.
    """
    limit = drafts.shape[0] if limit is None else limit
    if ends is not None and limit:
        limit = drafts_through_an_end(drafts[None, :limit], ends)[0]
    stop = first_stop(criteria, sequence, drafts[:limit])
    if stop is None:
        return limit
    return stop if through_stop else stop - 1


def first_stop(criteria, sequence: torch.LongTensor, tokens: torch.LongTensor) -> int | None:
    """The first j such that `sequence` `[n]` followed by `tokens[:j]` (`[m]`) makes one of the stopping `criteria`
    fire; None if none does. Criteria are asked as a block can ask them, before the target scored its tokens: with
    `scores=None`."""
    if not criteria or not tokens.shape[0]:
        return None
    candidate = torch.cat([sequence, tokens.to(sequence.device)])
    for j in range(1, tokens.shape[0] + 1):
        prefix = candidate[None, : sequence.shape[0] + j]
        if any(bool(asked_without_scores(criterion, prefix).any()) for criterion in criteria):
            return j
    return None


# Set for a drafted call whose target alone would hand its stopping criteria the scores so far (it returns them:
# `return_dict_in_generate` with `output_scores`; else it hands them None, as drafting does).
CRITERIA_SEE_SCORES: contextvars.ContextVar[bool] = contextvars.ContextVar("domino_criteria_see_scores", default=False)


class ScoresNotYet(TypeError):
    """A stopping criterion read the scores a drafting loop asks it without (`UNSCORED`)."""


class _Unscored(tuple):
    """What drafting hands stopping criteria for `scores` where the target alone would hand its scores: nothing to
    read, and reading it says so, where `None` would let a criterion that reads scores only when given them never
    fire (and answer otherwise than beside the target alone)."""

    def _read(self, *args, **kwargs):
        raise ScoresNotYet("the criterion read `scores`, which drafting asks it without")

    __getitem__ = __len__ = __iter__ = __bool__ = __contains__ = __reversed__ = _read


UNSCORED = _Unscored()


@contextlib.contextmanager
def criteria_scores_withheld(generation_config: GenerationConfig) -> Iterator[None]:
    """Inside, drafting asks stopping criteria with `UNSCORED` for `scores` where the call returns its scores (the
    target alone then hands them to its criteria), and with None, as the target alone does, otherwise."""
    token = CRITERIA_SEE_SCORES.set(
        bool(generation_config.return_dict_in_generate and generation_config.output_scores)
    )
    try:
        yield
    finally:
        CRITERIA_SEE_SCORES.reset(token)


def asked_without_scores(criteria, input_ids: torch.LongTensor) -> torch.Tensor:
    """`criteria(input_ids, scores)` as a tensor (a criterion may answer one bool, as StoppingCriteriaList allows),
    `scores` None or `UNSCORED` (`criteria_scores_withheld`): how drafting loops ask stopping criteria, before or
    without the target's scores of the tokens asked about. A criterion that reads the scores fails there, with the fix
    named."""
    try:
        return torch.as_tensor(criteria(input_ids, UNSCORED if CRITERIA_SEE_SCORES.get() else None))
    except (TypeError, AttributeError, IndexError) as error:
        raise ValueError(
            f"A stopping criterion failed when asked without scores ({type(error).__name__}: {error}; {criteria!r}). "
            "With a drafter, stopping criteria are asked at each draft before the target has scored it, so a "
            "criterion that reads `scores` cannot be served: decide from the tokens (`input_ids`) alone, or generate "
            "without assistant_model."
        ) from error


def drafts_through_an_end(drafts: torch.LongTensor, ends: torch.Tensor) -> list[int]:
    """Per row of `drafts` `[rows, k]`, how many come up to and with its first EOS token (`ends`), k where none does
    (read back once for all rows)."""
    hits = torch.isin(drafts, ends.to(drafts.device))
    first = torch.where(hits.any(dim=1), hits.int().argmax(dim=1) + 1, drafts.shape[1])
    return first.tolist()


# Logits processors that read one row of scores and nothing else (not input_ids): they can run on all rows of a batch
# at once, and on a draft vocabulary's columns alone (the tokens outside it have probability zero either way).
SCORE_ONLY_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, SortFreeTopP, MinPLogitsWarper)


def score_only(logits_processor) -> bool:
    """Whether every processor of the list (none counts) reads the scores alone."""
    return all(type(processor) in SCORE_ONLY_WARPERS for processor in logits_processor or ())


def drafting_vocab(vocab: torch.Tensor | None, logits_processor, ends: torch.Tensor | None) -> torch.Tensor | None:
    """The sorted token ids a call drafts over: the draft vocabulary `vocab`, with the EOS tokens `ends` added where
    processors that read tokens are shown its logits spread over the whole vocabulary (`processed_pick`).

    Spread, a token outside the vocabulary has the logit `-inf`; NaN/inf removal (`remove_invalid_values`) makes
    that the most negative float, and the exponential length penalty, which adds to the EOS's logit its magnitude
    times a growing factor, then takes it past the largest: NaN, where the target alone's EOS logit is finite. With
    the EOS among the drafts' columns its logit is the drafter's own, as the target's is.
    """
    if vocab is None or ends is None or score_only(logits_processor):
        return vocab
    ends = ends.flatten().to(vocab)
    missing = ends[~torch.isin(ends, vocab)]
    return vocab if not missing.numel() else torch.cat([vocab, missing.unique()]).sort().values


def spread_to_vocabulary(logits: torch.Tensor, vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary logits over the whole vocabulary, `-inf` elsewhere (a zero draft probability there)."""
    if vocab is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, vocab.to(logits.device), logits)


def processed_pick(logits_processor, do_sample: bool, vocab: torch.Tensor | None, vocab_size: int) -> Pick:
    """A `Pick` from the same processed distribution the assisted-decoding loop will use for the target.

    The logits come back over the whole vocabulary, `-inf` outside a draft vocabulary: the draft distribution is then
    exactly zero there, which keeps speculative sampling lossless. Logits processors see the whole vocabulary and the
    realised sequence, so a draft vocabulary's logits are spread before them, unless every processor reads the scores
    alone (temperature, top-k, top-p, min-p; or none): those give the same distribution over the vocabulary's
    columns, where they and the draw cost a sixth as much for the shipped drafter's 8192 of 49152 tokens (a sort and
    a draw over the whole vocabulary took 1.5 ms per drafted position on a 2-core CPU), so they run there and the
    logits are spread after.
    """
    on_columns = vocab is not None and score_only(logits_processor)

    def pick(logits: torch.Tensor, realised_ids: torch.LongTensor) -> tuple[torch.LongTensor, torch.Tensor]:
        logits = logits.float()
        if not on_columns:
            logits = spread_to_vocabulary(logits, vocab, vocab_size)
        if logits_processor is not None:
            logits = logits_processor(realised_ids.to(logits.device), logits)
        if do_sample:
            index = torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1)
        else:
            index = logits.argmax(dim=-1, keepdim=True)
        if on_columns:  # a column of the vocabulary: its token id, the token's column once spread
            index, logits = to_vocab_ids(index, vocab), spread_to_vocabulary(logits, vocab, vocab_size)
        return index, logits

    return pick


__all__ = [
    "BlockDraft",
    "CallStops",
    "DrafterContext",
    "Drafts",
    "KeepRolling",
    "Pick",
    "Rollout",
    "RowsRollout",
    "draft_block",
    "draft_confidence",
    "eager_rollout",
    "greedy_pick",
    "picked_probability",
    "processed_pick",
    "run_backbone",
    "score_only",
    "select_fused_rollout",
    "spread_to_vocabulary",
    "drafting_vocab",
    "drafts_through_an_end",
    "asked_without_scores",
    "criteria_scores_withheld",
    "first_stop",
    "reads_the_tokens",
    "stop_free_length",
    "within_block",
]
