"""Random requests over HTTP to `hf-domino serve`, with the drafter and without it (`--no-drafter`, the target alone
on the same server): every greedy answer with the drafter is asserted identical to the target alone's, every sampled
one well-formed. The option mixes of the test suite, for the server as a user reaches it.

Each request draws an endpoint (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`), streamed or not, a
length, greedy or sampled (temperature, top-p, seed), and what the endpoint takes besides: a frequency penalty, a
logit bias, stop strings, and a `generation_config` of its own (repetition penalty, n-gram ban, minimum length, and
decoding modes the drafter leaves to the target alone: beam search, prompt lookup). The drafter's server answers
first, one request at a time, then the target alone's; with `--continuous-batching` the drafter's server batches
them (`--concurrency` requests in flight at once), and each answer is compared with the target alone's
one-at-a-time answer to what transformers' continuous batching honours of the request (its length, and its
sampling settings where the model's generation config samples, which SmolLM2's does not: every answer greedy; a
folder of SmolLM2 with a sampling generation config, `--model FOLDER`, makes them count).

    python examples/serve_mixes.py --requests 40 --seed 0
    python examples/serve_mixes.py --requests 40 --seed 0 --continuous-batching --concurrency 4
    python examples/serve_mixes.py --requests 8 --seed 4 --serve-option compile=true   # a static cache per request
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from serve_http import start_server
from transformers import GenerationConfig

from hf_domino.prompt_sets import load_prompts

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses"}
# A request's own generation settings (`generation_config`, a JSON string): each drawn on its own.
GENERATION_CONFIGS = {
    "repetition_penalty": [1.2],
    "no_repeat_ngram_size": [3],
    "min_new_tokens": [6],
    "num_beams": [2],  # the drafter leaves beam search to the target alone
    "prompt_lookup_num_tokens": [4],  # and prompt lookup
    "suppress_tokens": [[198, 30]],
}
STOPS = ["\n\n", ".", "def ", "```"]


def random_request(rng: random.Random, prompts: list[str], continuous_batching: bool) -> dict:
    """What one request sends: its endpoint, whether it streams, and its body."""
    kind = rng.choice(["chat", "chat", "completions", "responses"])
    text = rng.choice(prompts)
    body = {"stream": rng.random() < 0.5}  # the model is named as the server names it (`answers_of`)
    limit = rng.randint(1, 40)
    if kind == "chat":
        body.update(messages=[{"role": "user", "content": text}], max_tokens=limit)
    elif kind == "completions":
        body.update(prompt=text, max_tokens=limit)
    else:
        body.update(input=text, max_output_tokens=limit)
    if rng.random() < 0.7:
        body["temperature"] = 0
    else:
        body.update(temperature=rng.choice([0.5, 1.0]), seed=rng.randrange(1000))
        if rng.random() < 0.5:
            body["top_p"] = 0.9
    if continuous_batching:  # transformers' continuous batching drops the rest (its runner's settings)
        return {"kind": kind, "body": body}
    if kind != "responses" and rng.random() < 0.25:
        body["frequency_penalty"] = rng.choice([0.2, 0.5])
    if kind == "chat" and rng.random() < 0.25:  # (floats: transformers 5.25 refuses a bias given as an int)
        body["logit_bias"] = {str(rng.randrange(49152)): rng.choice([-100.0, 5.0])}
    if kind != "responses" and rng.random() < 0.25:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if rng.random() < 0.3:
        names = rng.sample(sorted(GENERATION_CONFIGS), rng.randint(1, 2))
        body["generation_config"] = json.dumps({name: rng.choice(GENERATION_CONFIGS[name]) for name in names})
    return {"kind": kind, "body": body}


def send(port: int, model: str, request: dict) -> dict:
    """One request's answer: its text and why it ended (`error`: the status and message where it failed)."""
    data = json.dumps({"model": model, **request["body"]}).encode()
    http = urllib.request.Request(
        f"http://localhost:{port}{ENDPOINTS[request['kind']]}", data, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(http, timeout=600) as response:
            if request["body"]["stream"]:
                events = [json.loads(line[6:]) for line in response if line.startswith(b"data: {")]
                return streamed_answer(request["kind"], events)
            return whole_answer(request["kind"], json.loads(response.read()))
    except urllib.error.HTTPError as error:
        return {"error": f"{error.code}: {error.read().decode()[:300]}"}


def whole_answer(kind: str, answer: dict) -> dict:
    if kind == "responses":
        texts = [part["text"] for item in answer["output"] for part in item.get("content") or [] if "text" in part]
        return {"text": "".join(texts), "end": answer.get("status")}
    choice = answer["choices"][0]
    text = choice["message"]["content"] if kind == "chat" else choice["text"]
    return {"text": text or "", "end": choice["finish_reason"]}


def streamed_answer(kind: str, events: list[dict]) -> dict:
    if kind == "responses":
        text = "".join(event.get("delta", "") for event in events if event.get("type") == "response.output_text.delta")
        ends = [event["response"]["status"] for event in events if event.get("type") == "response.completed"]
        return {"text": text, "end": ends[-1] if ends else None}
    choices = [event["choices"][0] for event in events if event.get("choices")]
    pieces = [
        (choice.get("delta") or {}).get("content") if kind == "chat" else choice.get("text") for choice in choices
    ]
    ends = [choice["finish_reason"] for choice in choices if choice.get("finish_reason")]
    return {"text": "".join(piece or "" for piece in pieces), "end": ends[-1] if ends else None}


def config_samples(model: str) -> bool:
    """Whether the served model's generation config samples (a folder's; the offline targets' do not)."""
    return Path(model, "generation_config.json").exists() and bool(GenerationConfig.from_pretrained(model).do_sample)


def as_honoured(request: dict, samples: bool) -> dict:
    """The request as transformers' continuous batching serves it: its length, and its temperature, top-p and seed
    where the model's generation config samples (else decoded greedily)."""
    if samples:
        return request
    body = {name: value for name, value in request["body"].items() if name not in ("seed", "top_p")}
    body["temperature"] = 0
    return {"kind": request["kind"], "body": body}


def answers_of(options: list[str], requests: list[dict], continuous_batching: bool, concurrency: int) -> list[dict]:
    server, port = start_server(options, continuous_batching)
    try:
        with urllib.request.urlopen(f"http://localhost:{port}/v1/models", timeout=30) as response:
            (model,) = [entry["id"] for entry in json.loads(response.read())["data"]]
        if continuous_batching:
            with ThreadPoolExecutor(concurrency) as pool:
                return list(pool.map(lambda request: send(port, model, request), requests))
        return [send(port, model, request) for request in requests]
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="the target, as hf-domino serve takes it")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--continuous-batching", action="store_true")
    parser.add_argument("--concurrency", type=int, default=4, help="with --continuous-batching: requests at once")
    parser.add_argument(
        "--serve-option", action="append", default=[], help="NAME=VALUE, passed to both servers (hf-domino serve's)"
    )
    args = parser.parse_args()
    served = [args.model] + [argument for option in args.serve_option for argument in ("--serve-option", option)]
    rng = random.Random(args.seed)
    prompts = [messages[0]["content"] for name in ("mtbench", "humaneval") for messages in load_prompts(name, 10)]
    requests = [random_request(rng, prompts, args.continuous_batching) for _ in range(args.requests)]
    drafted = answers_of(served, requests, args.continuous_batching, args.concurrency)
    samples = config_samples(args.model)
    references = [as_honoured(request, samples) for request in requests] if args.continuous_batching else requests
    alone = answers_of([*served, "--no-drafter"], references, False, 1)
    failures = 0
    for i, (request, reference, ours, theirs) in enumerate(zip(requests, references, drafted, alone, strict=True)):
        greedy = reference["body"].get("temperature") == 0
        same = ours == theirs if greedy else ("error" in ours) == ("error" in theirs)
        if not same:
            failures += 1
            print(f"request {i} differs: {json.dumps(request)}\n  drafter:      {ours}\n  target alone: {theirs}")
    for i, answer in enumerate(alone):
        if "error" in answer:
            print(f"request {i}, refused by both: {json.dumps(requests[i]['body'])[:300]}\n  {answer['error'][:300]}")
    greedy = sum(reference["body"].get("temperature") == 0 for reference in references)
    errors = sum("error" in answer for answer in alone)
    mode = f"continuously batched, {args.concurrency} at once" if args.continuous_batching else "one at a time"
    print(
        f"{args.requests} requests ({mode}, seed {args.seed}): {greedy} greedy, {args.requests - greedy} sampled, "
        f"{errors} refused by both servers alike; {failures} differing"
    )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
