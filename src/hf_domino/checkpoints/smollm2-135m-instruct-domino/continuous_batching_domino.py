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

import copy
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.utils.logging import tqdm

from .batch_call_domino import check_batch_target
from .batching_domino import BatchedDecoding
from .options_domino import DominoGenerationStats, DominoOptions, check_drafter_for_target
from .ragged_cache_domino import JOINABLE, batch_cache
from .target_modules_domino import target_execution_device

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel

    from .modeling_domino import DominoForSpeculation

# Rows at a time where `ContinuousBatchingConfig.max_requests_per_batch` does not say.
DEFAULT_ROWS = 8


@dataclass
class Request:
    """One sequence to generate: a prompt of `generate_batch`'s inputs, or one of its `num_return_sequences`."""

    request_id: str
    prompt: torch.LongTensor
    admitted: float = 0.0
    timestamps: list[float] = field(default_factory=list)


def requests_of(inputs: list[list[int]], num_return_sequences: int, device: torch.device) -> list[Request]:
    """`generate_batch`'s requests in its results' order: `req_<i>` per prompt, after its extra sequences
    `req_<i>__child#<j>`."""
    requests = []
    for index, prompt in enumerate(inputs):
        try:
            ids = torch.as_tensor(prompt, dtype=torch.long, device=device)
        except (TypeError, ValueError, RuntimeError):
            ids = None
        if ids is None or ids.dim() != 1:
            raise ValueError(
                f"generate_batch takes each prompt as a list of token ids; prompt {index} is {type(prompt).__name__} "
                f"{str(prompt)[:60]!r}. Pass tokenizer(text)['input_ids'] (or apply_chat_template(..., "
                "return_dict=True)['input_ids']) for each prompt."
            )
        if ids.numel() == 0:
            raise ValueError(f"generate_batch's prompt {index} is empty: every request needs at least one token.")
        names = [f"req_{index}__child#{child}" for child in range(num_return_sequences - 1)] + [f"req_{index}"]
        requests += [Request(name, ids) for name in names]
    return requests


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
    generation_config.return_dict_in_generate = False
    return generation_config


def request_rules(
    target: PreTrainedModel, generation_config: GenerationConfig, prompt: torch.LongTensor, tokenizer: Any = None
) -> tuple[LogitsProcessorList, StoppingCriteriaList, int]:
    """The logits processors, stopping criteria and max_length generate() builds for `prompt` alone."""
    config = copy.copy(generation_config)
    if config.max_new_tokens is not None:
        config.max_length = prompt.shape[0] + config.max_new_tokens
    ids = prompt[None]
    processors = target._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=ids.shape[1],
        encoder_input_ids=ids,
        logits_processor=LogitsProcessorList(),
        device=ids.device,
        model_kwargs={"attention_mask": torch.ones_like(ids)},
    )
    criteria = target._get_stopping_criteria(config, StoppingCriteriaList(), tokenizer=tokenizer)
    return processors, criteria, config.max_length


def check_serving(target: PreTrainedModel, cache: DynamicCache, continuous_batching_config: Any) -> None:
    """Raises, naming the fix, for what a batch that rows join does not serve: log-probabilities, and targets whose
    cache (`cache`, as a batch starts it) holds more than keys and values per token (recurrent states, a sparse
    attention's indexer keys), which `RaggedCache.add_rows` cannot join."""
    if continuous_batching_config is not None and getattr(continuous_batching_config, "return_logprobs", False):
        raise ValueError(
            "generate_batch with a Domino drafter returns tokens, not their log-probabilities: drop return_logprobs, "
            "or call generate(..., output_scores=True) with the drafter on a padded batch."
        )
    others = sorted({type(layer).__name__ for layer in cache.layers if type(layer) not in JOINABLE})
    if getattr(target, "_is_stateful", False) or others:
        kept = ", ".join(others) or "its recurrent states"
        raise ValueError(
            f"{type(target).__name__}'s cache keeps more than keys and values per token ({kept}), which rows joining "
            "a running batch cannot bring: use generate() with the drafter on a left-padded batch of the prompts "
            "(docs/usage.md, 'Batches')."
        )


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
    device = target_execution_device(target)
    option_values = {name: kwargs.pop(name) for name in DominoOptions.names() if name in kwargs}
    tokenizer = kwargs.pop("tokenizer", None)  # for stop_strings, as generate() takes it
    generation_config = prepared_config(target, generation_config, kwargs, device)
    check_drafter_for_target(drafter, target, generation_config)
    options = DominoOptions.resolve(option_values, generation_config)
    options.validate(drafter)
    check_batch_target(target, generation_config, options)
    cache, window = batch_cache(DynamicCache(config=target.config), target)
    check_serving(target, cache, continuous_batching_config)
    requests = requests_of(inputs, generation_config.num_return_sequences or 1, device)
    rules = [request_rules(target, generation_config, request.prompt, tokenizer) for request in requests]
    limit = getattr(continuous_batching_config, "max_requests_per_batch", None) or DEFAULT_ROWS

    serving_config = copy.copy(generation_config)
    serving_config.max_length = max(max_length for _, _, max_length in rules)
    stats = DominoGenerationStats(timings={} if options.domino_timings else None)
    drafter.last_generation_stats = stats
    processors, criteria, _ = rules[0]  # every request's are of the same kinds: the call's drafting reads them
    decoding = BatchedDecoding(
        target, drafter, options, serving_config, processors, criteria, stats,
        torch.empty(0, 0, dtype=torch.long, device=device), None, cache, window,
    )  # fmt: skip
    return Serving(decoding, list(zip(requests, rules)), limit, record_timestamps).run(progress_bar)


class Serving:
    """One `generate_batch` call's requests: those waiting, those running as rows of `decoding` (at most `limit`),
    and the results of those done."""

    def __init__(self, decoding: BatchedDecoding, waiting: list, limit: int, record_timestamps: bool):
        self.decoding, self.limit, self.record_timestamps = decoding, limit, record_timestamps
        decoding.row_limit = limit  # so that the call is judged against plain steps joining as it joins
        self.waiting: deque = deque(waiting)  # (request, its processors, criteria and max_length)
        self.order = [request.request_id for request, _ in waiting]
        self.running: dict[int, Request] = {}  # row of `decoding` -> its request
        self.results: dict[str, GenerationOutput] = {}

    def run(self, progress_bar: bool) -> dict[str, GenerationOutput]:
        """Admit, cycle, retire until no request waits and no row runs; results in the requests' order."""
        decoding, finished = self.decoding, []
        desc = f"Solving {len(self.order)} requests"
        with tqdm(total=len(self.order), disable=not progress_bar, desc=desc, unit="request") as bar:
            while True:
                bar.update(self.retire(finished))
                if self.waiting and len(decoding.active) < self.limit:
                    finished = [False] * len(decoding.active) + self.admit()
                    continue  # retires the requests done at their first token, then takes on more
                if not decoding.active:
                    break
                finished = decoding.cycle()
                decoding.speculating = decoding.speculating and not decoding.losing()
        decoding.judge_call()
        return {request_id: self.results[request_id] for request_id in self.order}

    def admit(self) -> list[bool]:
        """As many waiting requests as there is room for join the batch (`BatchedDecoding.admit`)."""
        joining = [
            self.waiting.popleft() for _ in range(min(len(self.waiting), self.limit - len(self.decoding.active)))
        ]
        now, first = time.perf_counter(), len(self.decoding.sequences)
        for offset, (request, _) in enumerate(joining):
            request.admitted = now
            self.running[first + offset] = request
        return self.decoding.admit([(request.prompt, *rules) for request, rules in joining])

    def retire(self, finished: list[bool]) -> int:
        """The finished rows' requests get their results and leave the batch; returns how many."""
        now, decoding = time.perf_counter(), self.decoding
        if self.record_timestamps:  # the tokens each running row got since the last time
            for row in decoding.active:
                stamps = self.running[row].timestamps
                stamps += [now] * (decoding.generated(row) - len(stamps))
        done = [row for row, flag in zip(decoding.active, finished) if flag]
        for row in done:
            request = self.running.pop(row)
            self.results[request.request_id] = GenerationOutput(
                request_id=request.request_id,
                prompt_ids=request.prompt.tolist(),
                generated_tokens=decoding.sequences[row][decoding.prompt_lengths[row] :].tolist(),
                status=RequestStatus.FINISHED,
                lifespan=(request.admitted, now),
                timestamps=request.timestamps if self.record_timestamps else None,
            )
        decoding.retire(finished)
        return len(done)


__all__ = ["DEFAULT_ROWS", "generate_requests"]
