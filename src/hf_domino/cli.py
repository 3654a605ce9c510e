"""`hf-domino` command line: one sub-command per module, imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module exposes `add_arguments(parser)` and `run(args) -> int | None`.
COMMANDS = {
    "regenerate": ("hf_domino.training.regenerate", "regenerate training responses with the target"),
    "pack": ("hf_domino.training.packed", "pack regenerated token ids into one compact file to commit"),
    "train": ("hf_domino.training.command", "train a Domino drafter"),
    "bench": ("hf_domino.bench", "benchmark speculative decoding methods"),
    "demo": ("hf_domino.demo", "stream an answer from SmolLM2 with the shipped drafter"),
    "draft-vocab": ("hf_domino.draft_vocab", "give a drafter a draft vocabulary of the most frequent tokens"),
    "export": ("hf_domino.export", "export a drafter folder for the Hub (weights, remote code, model card)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="hf-domino", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text)
        sub_parser.set_defaults(module_name=module_name)
    # Parse the command name first so that only the chosen module is imported.
    known, rest = parser.parse_known_args(argv[:1])
    module = importlib.import_module(known.module_name)
    command_parser = argparse.ArgumentParser(prog=f"hf-domino {known.command}", description=COMMANDS[known.command][1])
    module.add_arguments(command_parser)
    args = command_parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
