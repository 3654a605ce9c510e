"""`target.generate_batch(prompts, assistant_model=drafter)`: a drafted batch that takes on the next request as rows finish.

transformers' `generate_batch` (continuous batching: requests join and leave a running batch) takes no assistant
model: in 5.23-5.24 it drops `assistant_model=` without a word and decodes one token per step. With a Domino drafter
the generate() hook hands the call here instead. The requests run through the drafted batch of `batching_domino`
(`BatchedDecoding`), at most `max_requests_per_batch` rows at a time (`ContinuousBatchingConfig`, else
`DEFAULT_ROWS`), and as soon as rows finish the waiting requests join it (`BatchedDecoding.admit`: each prompt read
alone, its cache joined to the batch's). A batch from `generate()` ends with its last row, and its last cycles run with
a few rows for nearly a full step's price (docs/benchmarks.md, "The batch's tail"); here the batch stays full while
requests wait.

Each request generates what `target.generate(prompt, generation_config)` generates for it alone (greedy: the same
tokens; sampling: the same law), with the logits processors and stopping criteria generate() builds for that prompt,
all of them, where transformers' continuous batching drops those it has no batched version of.

This file is also written next to exported checkpoints as remote code (transformers + torch only).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.utils.logging import tqdm

from .attention_kernels_domino import drafting_attention_kernels
from .batch_call_domino import check_batch_target
from .batch_policy_domino import call_speculates
from .batching_domino import BatchedDecoding
from .cache_domino import check_croppable
from .options_domino import DominoGenerationStats, DominoOptions, check_drafter_for_target
from .ragged_cache_domino import batch_cache
from .recurrent_cache_domino import check_recurrent_call, check_recurrent_target, keeps_recurrent_states
from .target_modules_domino import target_execution_device
from .warpers_domino import sort_free_top_p

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel

    from .modeling_domino import DominoForSpeculation

# Rows at a time where `ContinuousBatchingConfig.max_requests_per_batch` does not say.
DEFAULT_ROWS = 8


@dataclass
class Request:
    """One sequence to generate: a prompt of `generate_batch`'s inputs (or of a manager's request), or one of its
    `num_return_sequences`."""

    request_id: str
    prompt: torch.LongTensor
    streaming: bool = False  # its tokens so far after each of its cycles, not only its result
    record_timestamps: bool = False
    created: float = field(default_factory=time.perf_counter)
    admitted: float = -1.0
    timestamps: list[float] = field(default_factory=list)
    streamed: int = 0  # tokens already streamed
    cancelled: bool = False


def requests_of(inputs: list[list[int]], num_return_sequences: int, call: ServingCall) -> list[Request]:
    """`generate_batch`'s requests in its results' order: `req_<i>` per prompt, after its extra sequences
    `req_<i>__child#<j>`."""
    requests = []
    for index, prompt in enumerate(inputs):
        ids = prompt_ids(prompt, call.device, f"generate_batch's prompt {index}", call.vocab_size)
        requests += [Request(name, ids) for name in sequence_ids(f"req_{index}", num_return_sequences)]
    return requests


def prompt_ids(prompt: Any, device: torch.device, what: str, vocab_size: int | None = None) -> torch.LongTensor:
    """A request's prompt as a 1-D tensor of token ids (each below `vocab_size`, where given); raises, naming the fix,
    for anything else."""
    try:
        ids = torch.as_tensor(prompt, device=device)
    except (TypeError, ValueError, RuntimeError):
        ids = None
    if ids is not None and ids.numel() == 0 and ids.dim() == 1:
        raise ValueError(f"{what} is empty: every request needs at least one token.")
    integers = ids is not None and not ids.is_floating_point() and not ids.is_complex() and ids.dtype != torch.bool
    if not integers or ids.dim() != 1:
        raise ValueError(
            f"{what} is {type(prompt).__name__} {str(prompt)[:60]!r}, where a prompt is a list of token ids (integers). "
            "Pass tokenizer(text)['input_ids'] (or apply_chat_template(..., return_dict=True)['input_ids'])."
        )
    ids = ids.long()
    if vocab_size is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise ValueError(
            f"{what} holds token id {bad}, outside the target's vocabulary of {vocab_size}: was it tokenized for "
            "another model?"
        )
    return ids


def sequence_ids(request_id: str, num_return_sequences: int) -> list[str]:
    """A request's sequences as transformers names them: its extra ones `<id>__child#<j>`, then `<id>`."""
    return [f"{request_id}__child#{child}" for child in range(num_return_sequences - 1)] + [request_id]


def prepared_config(
    target: PreTrainedModel, generation_config: GenerationConfig | None, kwargs: dict[str, Any], device: torch.device
) -> GenerationConfig:
    """The call's generation config as generate() prepares it (the model's defaults, then `kwargs`); raises for
    keyword arguments that are no generation setting."""
    generation_config, unknown = target._prepare_generation_config(generation_config, **kwargs)
    if unknown:
        raise TypeError(
            "generate_batch with a Domino drafter takes generation settings as keyword arguments (max_new_tokens, "
            f"do_sample, ...) and the drafter's options (draft_policy, domino_lookup, ...); got {sorted(unknown)}."
        )
    if generation_config.num_beams > 1:
        raise ValueError(
            "generate_batch with a Domino drafter decodes greedily or samples: drop num_beams (or set it to 1)."
        )
    target._prepare_special_tokens(generation_config, True, device=device)
    generation_config.output_scores = generation_config.output_logits = False  # results carry tokens only
    # Continuous batching keeps a cache of its own whatever `use_cache` says (`transformers serve` sets it False for
    # its manager); so does a drafted batch.
    generation_config.use_cache = True
    generation_config.return_dict_in_generate = False
    return generation_config


def has_default_max_length(
    target: PreTrainedModel, generation_config: GenerationConfig | None, kwargs: dict[str, Any]
) -> bool:
    """Whether no `max_length` was set (by keyword, in the config given or in the model's), as generate() asks before
    it fills in the defaults: it then generates 20 new tokens, not 20 in all (`request_rules`)."""
    return (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and target.generation_config.max_length is None
    )


def request_rules(
    target: PreTrainedModel,
    generation_config: GenerationConfig,
    prompt: torch.LongTensor,
    tokenizer: Any = None,
    default_max_length: bool = False,
    **settings: Any,
) -> tuple[LogitsProcessorList, StoppingCriteriaList, int]:
    """The logits processors, stopping criteria and max_length generate() builds for `prompt` alone, with the
    generation `settings` of its own (`max_new_tokens`, `temperature`, ...) over `generation_config`'s.

    Raises a `ValueError` where generate() would refuse the length (a `max_length` the prompt already reaches), or
    fail on it: a `max_new_tokens` that is not a positive integer (a float failed the thread of a manager serving it
    and every request it held).
    """
    config = copy.copy(generation_config)
    for name, value in settings.items():
        setattr(config, name, value)
    length = prompt.shape[0]
    if config.max_new_tokens is not None:
        if (
            isinstance(config.max_new_tokens, bool)
            or not isinstance(config.max_new_tokens, int)
            or config.max_new_tokens < 1
        ):
            raise ValueError(f"max_new_tokens must be a positive integer, got {config.max_new_tokens!r}.")
        config.max_length = length + config.max_new_tokens
    elif default_max_length:  # generate()'s default: 20 new tokens, within the model's positions
        config.max_length = length + config.max_length
        positions = getattr(target.config, "max_position_embeddings", None)
        config.max_length = config.max_length if positions is None else min(config.max_length, positions)
    if length >= config.max_length:
        raise ValueError(
            f"Input length of input_ids is {length}, but `max_length` is set to {config.max_length}: raise "
            "max_length, or better, set max_new_tokens."
        )
    ids = prompt[None]
    processors = target._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=ids.shape[1],
        encoder_input_ids=ids,
        logits_processor=LogitsProcessorList(),
        device=ids.device,
        model_kwargs={"attention_mask": torch.ones_like(ids)},
    )
    sort_free_top_p(processors)
    criteria = target._get_stopping_criteria(config, StoppingCriteriaList(), tokenizer=tokenizer)
    return processors, criteria, config.max_length


def check_serving(
    target: PreTrainedModel,
    cache: DynamicCache,
    generation_config: GenerationConfig,
    options: DominoOptions,
    continuous_batching_config: Any,
) -> None:
    """Raises, naming the fix, for what a batch that rows join does not serve: log-probabilities, and what a
    drafted batch does not serve on a target with recurrent states (`check_recurrent_call`), `cache` as a batch
    starts it."""
    if continuous_batching_config is not None and getattr(continuous_batching_config, "return_logprobs", False):
        raise ValueError(
            "generate_batch with a Domino drafter returns tokens, not their log-probabilities: drop return_logprobs, "
            "or call generate(..., output_scores=True) with the drafter on a padded batch."
        )
    if keeps_recurrent_states(target):
        check_recurrent_target(target)
        check_recurrent_call(target, cache, generation_config, batched=True, branches=options.domino_branches)


@dataclass
class ServingCall:
    """What every request of a `generate_batch` call, or of a manager's, shares: the models, the generation config
    as generate() prepares it, the drafter's options, and the rows at a time."""

    target: PreTrainedModel
    drafter: DominoForSpeculation
    generation_config: GenerationConfig
    options: DominoOptions
    limit: int
    tokenizer: Any = None  # for stop strings, as generate() takes it
    default_max_length: bool = False  # no max_length set anywhere: 20 new tokens per request, as generate() gives

    @classmethod
    def prepare(
        cls,
        target: PreTrainedModel,
        drafter: DominoForSpeculation,
        generation_config: GenerationConfig | None,
        continuous_batching_config: Any,
        kwargs: dict[str, Any],
    ) -> ServingCall:
        """The call's settings from generation settings and drafter options as keyword arguments beside a
        `GenerationConfig`; raises, naming the fix, for what a drafted batch that rows join cannot serve."""
        device = target_execution_device(target)
        kwargs = dict(kwargs)
        option_values = {name: kwargs.pop(name) for name in DominoOptions.names() if name in kwargs}
        tokenizer = kwargs.pop("tokenizer", None)
        default_max_length = has_default_max_length(target, generation_config, kwargs)
        generation_config = prepared_config(target, generation_config, kwargs, device)
        check_drafter_for_target(drafter, target, generation_config)
        options = DominoOptions.resolve(option_values, generation_config)
        options.validate(drafter)
        check_batch_target(target, generation_config, options)
        cache = DynamicCache(config=target.config)
        check_croppable(target, cache, batched=True)
        check_serving(target, batch_cache(cache, target)[0], generation_config, options, continuous_batching_config)
        limit = getattr(continuous_batching_config, "max_requests_per_batch", None)
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            # A negative count admitted no request and stepped nothing, forever; 0 became the default in silence.
            raise ValueError(
                f"Got max_requests_per_batch = {limit!r} but expected an integer >= 1 (or None: {DEFAULT_ROWS} rows)."
            )
        return cls(target, drafter, generation_config, options, limit or DEFAULT_ROWS, tokenizer, default_max_length)

    @property
    def device(self) -> torch.device:
        return target_execution_device(self.target)

    @property
    def vocab_size(self) -> int:
        """The rows of the target's embedding table: a prompt's ids must be below it."""
        return self.target.get_input_embeddings().num_embeddings

    def rules(
        self, prompt: torch.LongTensor, max_new_tokens: int | None = None, sampling: dict[str, Any] | None = None
    ) -> tuple:
        """`request_rules` for `prompt`, with the request's own `max_new_tokens` and sampling settings (`temperature`,
        `top_k`, `top_p`: `DraftedBatchingManager.add_request`) where it names them."""
        settings = dict(sampling or {}, **({} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}))
        return request_rules(
            self.target, self.generation_config, prompt, self.tokenizer, self.default_max_length, **settings
        )

    def decoding(self, rules: tuple) -> BatchedDecoding:
        """A `BatchedDecoding` with no rows yet, for requests that join it (`BatchedDecoding.admit`) with rules of
        the kinds of `rules` (one request's: the drafting reads them once, and every request's are of those kinds)."""
        cache, window = batch_cache(DynamicCache(config=self.target.config), self.target)
        config = copy.copy(self.generation_config)
        processors, criteria, config.max_length = rules
        stats = DominoGenerationStats(timings={} if self.options.domino_timings else None)
        self.drafter.last_generation_stats = stats
        return BatchedDecoding(
            self.target, self.drafter, self.options, config, processors, criteria, stats,
            torch.empty(0, 0, dtype=torch.long, device=self.device), None, cache, window,
        )  # fmt: skip

    def kernels(self) -> contextlib.AbstractContextManager:
        """The attention kernels a drafting call runs with (`drafting_attention_kernels`)."""
        return drafting_attention_kernels(self.device, self.target.dtype, self.options.domino_cudnn_attention)


@torch.no_grad()
def generate_requests(
    target: PreTrainedModel,
    drafter: DominoForSpeculation,
    inputs: list[list[int]],
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: Any = None,
    record_timestamps: bool = False,
    progress_bar: bool = False,
    **kwargs: Any,
) -> dict[str, GenerationOutput]:
    """`generate_batch` with a Domino drafter: every request, drafted in a batch of at most `max_requests_per_batch`
    rows that takes on waiting requests as rows finish. Returns transformers' `GenerationOutput` per request id, in
    `generate_batch`'s order; `drafter.last_generation_stats` has the call's drafting statistics."""
    if not inputs:
        return {}
    call = ServingCall.prepare(target, drafter, generation_config, continuous_batching_config, kwargs)
    requests = requests_of(inputs, call.generation_config.num_return_sequences or 1, call)
    rules = [call.rules(request.prompt) for request in requests]
    longest = max(rules, key=lambda each: each[2])  # the decoding's max_length: the cache's first reserve
    results: dict[str, GenerationOutput] = {}
    with call.kernels():
        decoding = call.decoding(longest)
        serving = Serving(decoding, call.limit, lambda result: results.__setitem__(result.request_id, result))
        for request, request_rules_ in zip(requests, rules):
            request.record_timestamps = record_timestamps
            serving.add(request, request_rules_)
        desc = f"Solving {len(requests)} requests"
        with tqdm(total=len(requests), disable=not progress_bar, desc=desc, unit="request") as bar:
            while serving.busy:
                bar.update(serving.step())
        decoding.judge_call()
    return {request.request_id: results[request.request_id] for request in requests}


class Serving:
    """One drafted batch's requests: those waiting, those running as rows of `decoding` (at most `limit`), and, as
    each finishes, its result handed to `deliver` (a streaming request's tokens so far after each of its cycles too).
    `generate_requests` runs one to the end; `DraftedBatchingManager` feeds one requests as they arrive."""

    def __init__(self, decoding: BatchedDecoding, limit: int, deliver: Callable[[GenerationOutput], None]):
        self.decoding, self.limit, self.deliver = decoding, limit, deliver
        # So that the call is judged against plain steps joining as its requests joined, none before it came.
        decoding.window.limit, decoding.window.arrivals = limit, []
        self.started: float | None = None  # when the first request joined
        self.waiting: deque = deque()  # (request, its processors, criteria and max_length)
        self.running: dict[int, Request] = {}  # row of `decoding` -> its request
        self.finished: list[bool] = []  # per active row, whether its last cycle (or prefill) finished it
        self.admitted = 0  # requests taken on so far

    @property
    def busy(self) -> bool:
        """Whether a request waits or runs (a finished row runs until `step` retires it)."""
        return bool(self.waiting or self.decoding.active)

    def add(self, request: Request, rules: tuple) -> None:
        self.waiting.append((request, rules))

    def cancel(self, request_id: str) -> bool:
        """Drops the request, waiting or running, without a result; False if it is neither."""
        for entry in self.waiting:
            if entry[0].request_id == request_id:
                self.waiting.remove(entry)
                return True
        for request in self.running.values():
            if request.request_id == request_id:
                request.cancelled = True
                return True
        return False

    def step(self) -> int:
        """Retires the rows finished last, then admits waiting requests where there is room, else runs one cycle of
        the active rows. Returns how many requests finished."""
        decoding = self.decoding
        done = self.retire()
        if self.waiting and len(decoding.active) < self.limit:
            self.finished = [False] * len(decoding.active) + self.admit()
        elif decoding.active:
            self.finished = decoding.cycle()
            decoding.speculating = decoding.speculating and not decoding.losing()
        else:
            return done
        self.stream()
        return done

    def judge_window(self, every: int = 0, final: bool = False) -> None:
        """For a server that may never run dry: once `every` cycles have run since the last time (or the batch is
        done, `final`), judges them as a call (`judge_call`: the tokens each row generated in them, rows
        there at the window's start taken as come then), and the next window speculates or takes plain steps as the
        judge's pauses say (`call_speculates`), as a batch size's next call would."""
        decoding = self.decoding
        cycles = decoding.window.cycles
        if not cycles or (not final and len(cycles) < every):
            return
        decoding.judge_call()
        if decoding.judges_calls and not final:
            decoding.speculated = decoding.speculating = call_speculates(decoding.policy.record)
            if decoding.speculating:
                decoding.drafting.index_datastore()
        decoding.window.next(time.perf_counter() - (self.started or 0.0), decoding.cycle_tokens())

    def admit(self) -> list[bool]:
        """As many waiting requests as there is room for join the batch (`BatchedDecoding.admit`)."""
        joining = [
            self.waiting.popleft() for _ in range(min(len(self.waiting), self.limit - len(self.decoding.active)))
        ]
        now, first = time.perf_counter(), len(self.decoding.sequences)
        self.started = now if self.started is None else self.started
        for offset, (request, _) in enumerate(joining):
            request.admitted = now
            self.running[first + offset] = request
            self.decoding.window.arrivals.append(max(0.0, request.created - self.started))
        self.admitted += len(joining)
        return self.decoding.admit([(request.prompt, *rules) for request, rules in joining])

    def stamp(self, row: int, now: float) -> None:
        """A request that records timestamps: `now` for each token its row got since the last time."""
        request = self.running[row]
        if request.record_timestamps:
            request.timestamps += [now] * (self.decoding.generated(row) - len(request.timestamps))

    def output(self, row: int, status: RequestStatus, now: float) -> GenerationOutput:
        self.stamp(row, now)
        request, decoding = self.running[row], self.decoding
        return GenerationOutput(
            request_id=request.request_id,
            prompt_ids=request.prompt.tolist(),
            generated_tokens=decoding.sequences[row][decoding.prompt_lengths[row] :].tolist(),
            status=status,
            created_time=request.created,
            lifespan=(request.admitted, now if status == RequestStatus.FINISHED else -1),
            timestamps=list(request.timestamps) if request.record_timestamps else None,
        )

    def stream(self) -> None:
        """A streaming request's tokens so far, after each of its cycles that added some and did not finish it."""
        now, decoding = time.perf_counter(), self.decoding
        for row, done in zip(decoding.active, self.finished):
            request = self.running[row]
            if request.streaming and not done and not request.cancelled:
                if decoding.generated(row) > request.streamed:
                    request.streamed = decoding.generated(row)
                    self.deliver(self.output(row, RequestStatus.DECODING, now))

    def retire(self) -> int:
        """The finished rows' requests get their results and leave the batch, as do cancelled ones (no result);
        returns how many finished."""
        now, decoding = time.perf_counter(), self.decoding
        for row in decoding.active:
            self.stamp(row, now)
        finished = self.finished + [False] * (len(decoding.active) - len(self.finished))
        finished = [done or self.running[row].cancelled for row, done in zip(decoding.active, finished)]
        delivered = 0
        for row in [row for row, done in zip(decoding.active, finished) if done]:
            if not self.running[row].cancelled:
                self.deliver(self.output(row, RequestStatus.FINISHED, now))
                delivered += 1
            del self.running[row]
        decoding.retire(finished)
        self.finished = []
        return delivered


__all__ = ["DEFAULT_ROWS", "Serving", "ServingCall", "generate_requests"]
