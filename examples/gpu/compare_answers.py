"""Whether two regenerations of the same prompts gave the same answers (e.g. the GPU's against the committed CPU's).

python examples/gpu/compare_answers.py runs/check/train.jsonl data/smollm2-regen/ids.safetensors
"""

from __future__ import annotations

import argparse

from hf_domino.training.packed import iter_records, record_key


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first", help="regenerated jsonl or packed file")
    parser.add_argument("second", help="regenerated jsonl or packed file")
    args = parser.parse_args()
    first = {record_key(record): record for record in iter_records(args.first)}
    second = {record_key(record): record for record in iter_records(args.second)}
    common = sorted(first.keys() & second.keys(), key=str)
    identical = [key for key in common if first[key]["input_ids"] == second[key]["input_ids"]]
    tokens = sum(sum(first[key]["loss_mask"]) for key in identical)
    print(f"{len(first)} and {len(second)} records, {len(common)} prompts in both, {len(identical)} identical answers "
          f"({tokens} response tokens); differing: {[key for key in common if key not in identical][:10]}")  # fmt: skip


if __name__ == "__main__":
    main()
