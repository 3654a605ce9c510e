"""`hf-domino pack`: the committed form of regenerated data, every token id in one small safetensors file.

Regeneration is the expensive step of training (hours of target time on a CPU), while target features and optimizer
state are caches anyone can recompute. So the regenerated ids are what gets committed, compactly, with the recipe
that produced them, and anyone can retrain without regenerating. One file holds:

    token_ids       uint16 [total tokens] (int32 when an id does not fit: vocabularies over 65536)
    offsets         int64 [n + 1]: example i is token_ids[offsets[i] : offsets[i + 1]]
    prompt_lengths  int32 [n]: the loss mask is 0 on the prompt and 1 on the response, so it needs no storage
    keys            uint8: the examples' ids (or indices), utf-8, one per line

and one metadata entry, `hf_domino_packed`: sorted JSON with `format_version`, `token_dtype`, `key_kind` (`id` or
`index`), the `recipe` (`hf-domino regenerate`'s `out.recipe.json`: target, dtype, lengths, decoding, prompt sources
and their held-out rule, versions) and the `counts` (examples, tokens, response tokens, per source). Examples are
ordered by a hash of their key, so the file does not depend on the order in which resumed runs wrote them (the same
records and versions give the same bytes), and any prefix of it (`--max-examples`) is a balanced sample.

`unpack` gives back the records exactly as `hf-domino regenerate` wrote them; `training.data.load_examples` (and so
`hf-domino train --data`) reads packed files and jsonl files alike.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import assets
from ..cli import output_problem
from ..prompt_sets import InputDataError

FORMAT_VERSION = "1"
METADATA_KEY = "hf_domino_packed"
PACKED_SUFFIX = ".safetensors"
# Recipe entries that describe a run without deciding its answers: resumed runs may differ in them.
UNCHECKED_RECIPE_KEYS = ("versions", "device")
# Entries recipes record since a later release: compared only where both recipes hold them (earlier runs resume).
LATER_RECIPE_KEYS = ("target_folder", "prompts_file")
# Entries as typed, and what each resolves to where it names a file or folder: where both recipes hold the resolved
# one, it decides ("./model" from one folder and "model" from its parent are the same model).
RESOLVED_RECIPE_KEYS = {"target": "target_folder", "prompts": "prompts_file"}
Key = int | str  # a record's `index` (position in its source) or `id` (stable id in the training mix)


def record_key(record: dict[str, Any], source: str | os.PathLike | None = None) -> Key:
    """What identifies a regenerated record: its string `id` (training mix), else its integer `index`; `source` (the
    file it came from) is named in the error for a record with neither."""
    where = "A record" if source is None else f"A record of {source}"
    if isinstance(record.get("id"), str):
        return record["id"]
    if _is_int(record.get("index")) and record["index"] >= 0:
        return record["index"]
    if "id" in record or "index" in record:  # (a float index was read as its floor: another prompt's)
        raise InputDataError(
            f"{where} has id {record.get('id')!r} / index {record.get('index')!r}: `hf-domino regenerate` writes a "
            "string id or an integer index >= 0 on every record; pass files that command wrote."
        )
    raise InputDataError(
        f"{where} has neither `id` nor `index`, which `hf-domino regenerate` writes on every record: pass files that "
        "command wrote."
    )


def recipe_path(jsonl_path: str | os.PathLike) -> Path:
    """`out.recipe.json` beside `out.jsonl`: the recipe its records were regenerated with."""
    return Path(jsonl_path).with_suffix(".recipe.json")


def read_recipe(path: str | os.PathLike) -> dict[str, Any] | None:
    """The recipe of a packed file, or the one recorded beside a regeneration file (None: none was kept)."""
    if Path(path).suffix == PACKED_SUFFIX:
        return packed_info(path)["recipe"]
    sidecar = recipe_path(path)
    if not sidecar.exists():
        return None
    try:
        recipe = json.loads(sidecar.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        recipe = error
    if not isinstance(recipe, dict):
        raise InputDataError(
            f"{sidecar} is no recipe (a JSON object of the settings {path} was regenerated with): {recipe}. Restore "
            "it, or remove it with its regenerated file to start that file over."
        )
    return recipe


def recipe_differences(recorded: dict[str, Any], recipe: dict[str, Any]) -> list[str]:
    """The entries in which two recipes differ, but for `UNCHECKED_RECIPE_KEYS` (and `LATER_RECIPE_KEYS` one of them
    lacks): data from both may not be mixed."""
    recorded, recipe = json.loads(json.dumps(recorded)), json.loads(json.dumps(recipe))
    keys = (recorded.keys() | recipe.keys()) - set(UNCHECKED_RECIPE_KEYS)
    keys -= {key for key in LATER_RECIPE_KEYS if key not in recorded or key not in recipe}
    keys -= {
        typed for typed, resolved in RESOLVED_RECIPE_KEYS.items() if recorded.get(resolved) and recipe.get(resolved)
    }
    return sorted(key for key in keys if recorded.get(key) != recipe.get(key))


def read_keys(path: str | os.PathLike) -> set[Key]:
    """The keys of the records of a packed file or of a regeneration file (without reading the token ids)."""
    if Path(path).suffix != PACKED_SUFFIX:
        return {record_key(record) for record in iter_records(path)}
    info, tensors = _load(path, names=("keys",))
    keys = bytes(tensors["keys"]).decode().split("\n")
    return set(keys) if info["key_kind"] == "id" else {int(key) for key in keys}


def iter_records(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """The records of a `hf-domino regenerate` jsonl file, or of a packed file (by its `.safetensors` suffix).

    A last jsonl line without its newline that is no whole JSON value is a write in progress (or one cut short by a
    crash) and is skipped; a whole one (a file written by hand, its last newline left out) is read.
    """
    path = Path(path)
    if path.suffix == PACKED_SUFFIX:
        yield from unpack(path)
        return
    with open(path, encoding="utf-8") as file:
        for line_number, line in enumerate(file, start=1):
            if not line.endswith("\n") and not _whole_json(line):
                break
            if line.strip():
                yield _regenerated_record(line, f"{path}:{line_number}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _whole_json(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _regenerated_record(line: str, where: str) -> dict[str, Any]:
    """One jsonl line as a record, or an `InputDataError` at `where` (file:line) naming what such a line holds."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        record = None
    fields = ("input_ids", "loss_mask")
    if not isinstance(record, dict) or not all(isinstance(record.get(name), list) for name in fields):
        raise InputDataError(
            f"{where} is not a record of `hf-domino regenerate` (a JSON object with the lists input_ids and "
            "loss_mask): pass files that command wrote (or `hf-domino pack` files)."
        )
    ids, mask = record["input_ids"], record["loss_mask"]
    if not ids or not all(_is_int(token) and 0 <= token < 2**31 for token in ids):
        raise InputDataError(
            f"{where}: its input_ids must be token ids, integers from 0 (a float, a string or a negative id was "
            "packed as another token, or failed there). Pass files `hf-domino regenerate` wrote."
        )
    if not all(value in (0, 1) and not isinstance(value, float) for value in mask):
        raise InputDataError(f"{where}: its loss_mask must hold 0s and 1s. Pass files `hf-domino regenerate` wrote.")
    if len(ids) != len(mask):
        raise InputDataError(
            f"{where} has {len(record['input_ids'])} input_ids but a loss_mask of {len(record['loss_mask'])}: each "
            "token needs its mask entry. Pass files `hf-domino regenerate` wrote."
        )
    return record


def pack(
    jsonl_paths: str | os.PathLike | Sequence[str | os.PathLike],
    out_path: str | os.PathLike,
    recipe: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Pack the complete records of regeneration files into one safetensors file (see the module docstring).

    Args:
        jsonl_paths: files written by `hf-domino regenerate`; a record found in two files must be the same.
        out_path: the `.safetensors` file to write (replaced atomically).
        recipe: how the records were made, for files regenerated without a recipe; by default the
            `out.recipe.json` recorded beside the files. The recipes recorded must agree with it.

    Returns:
        What the file records about itself (`packed_info`): format, token dtype, key kind, `recipe` and `counts`.
    """
    from safetensors.numpy import save_file

    paths = [jsonl_paths] if isinstance(jsonl_paths, (str, os.PathLike)) else list(jsonl_paths)
    missing = [str(path) for path in paths if not Path(path).is_file()]
    if missing:
        raise FileNotFoundError(
            f"No regenerated data at {', '.join(missing)}: pass files `hf-domino regenerate` wrote."
        )
    if recipe is None:
        recipe = _recorded_recipe(paths)
    for path in paths:  # a recipe given for files without one must not relabel those regenerated otherwise
        if (recorded := read_recipe(path)) is not None and (differing := recipe_differences(recorded, recipe)):
            raise InputDataError(
                f"{path} was regenerated with another recipe than the one given ({', '.join(differing)} differ from "
                f"{recipe_path(path)}): pack it without --recipe (recipe=), or separately."
            )
    by_key: dict[Key, tuple[list[int], int]] = {}
    for path in paths:
        for record in iter_records(path):
            key, input_ids = record_key(record, path), record["input_ids"]
            prompt_length = _prompt_length(record, path)
            if by_key.setdefault(key, (input_ids, prompt_length)) != (input_ids, prompt_length):
                raise InputDataError(f"{path} holds another example for {key!r} than a file before it.")
    if not by_key:
        raise InputDataError(f"No complete records in {[str(path) for path in paths]}.")
    key_kinds = {type(key) for key in by_key}
    if lined := next((key for key in by_key if "\n" in str(key)), None):
        raise InputDataError(f"The record id {lined!r} holds a line break, which the packed file separates ids with.")
    if len(key_kinds) > 1:
        raise InputDataError("The files mix integer `index` and string `id` records; pack them separately.")

    keys = sorted(by_key, key=lambda key: hashlib.sha256(str(key).encode()).digest())
    lengths = np.array([len(by_key[key][0]) for key in keys], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat = np.fromiter((token for key in keys for token in by_key[key][0]), dtype=np.int64, count=int(offsets[-1]))
    if flat.size and flat.min() < 0:
        raise ValueError("Token ids must be >= 0.")
    token_dtype = np.uint16 if not flat.size or flat.max() <= np.iinfo(np.uint16).max else np.int32
    prompt_lengths = np.array([by_key[key][1] for key in keys], dtype=np.int32)
    info = {
        "format_version": FORMAT_VERSION,
        "token_dtype": np.dtype(token_dtype).name,
        "key_kind": "id" if str in key_kinds else "index",
        "recipe": recipe,
        "counts": _counts(keys, lengths, prompt_lengths),
        "packed_with": assets.package_versions("hf-domino", "safetensors", "numpy"),
    }
    tensors = {
        "token_ids": flat.astype(token_dtype),
        "offsets": offsets,
        "prompt_lengths": prompt_lengths,
        "keys": np.frombuffer("\n".join(str(key) for key in keys).encode(), dtype=np.uint8).copy(),
    }
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    temporary = out_path.with_name(out_path.name + ".tmp")
    # One metadata entry, its JSON sorted: safetensors writes several in hash order, and the same data must give the
    # same bytes (re-packing unchanged data leaves the committed file untouched).
    try:
        save_file(tensors, str(temporary), metadata={METADATA_KEY: json.dumps(info, sort_keys=True)})
        os.chmod(temporary, 0o644)  # a file to commit and share, not a private one
        os.replace(temporary, out_path)
    finally:  # a failed write (a folder in the way, a full disk) leaves nothing half-written
        temporary.unlink(missing_ok=True)
    return info


def unpack(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a packed file, as `hf-domino regenerate` wrote them: `{"id" | "index", "input_ids", "loss_mask"}`."""
    info, tensors = _load(path)
    key_field = info["key_kind"]
    keys = bytes(tensors["keys"]).decode().split("\n")
    token_ids, offsets, prompt_lengths = tensors["token_ids"], tensors["offsets"], tensors["prompt_lengths"]
    records = []
    for i, key in enumerate(keys):
        input_ids = token_ids[offsets[i] : offsets[i + 1]].tolist()
        prompt_length = int(prompt_lengths[i])
        records.append(
            {
                key_field: key if key_field == "id" else int(key),
                "input_ids": input_ids,
                "loss_mask": [0] * prompt_length + [1] * (len(input_ids) - prompt_length),
            }
        )
    return records


def packed_info(path: str | os.PathLike) -> dict[str, Any]:
    """What a packed file records about itself: format, `token_dtype`, `key_kind`, `recipe` and `counts`."""
    return _load(path, names=())[0]


def _load(
    path: str | os.PathLike, names: Sequence[str] = ("token_ids", "offsets", "prompt_lengths", "keys")
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as file:
            info = json.loads((file.metadata() or {}).get(METADATA_KEY, "{}"))
            if info.get("format_version") == FORMAT_VERSION:
                return info, {name: file.get_tensor(name) for name in names}
    except SafetensorError:
        pass
    raise InputDataError(
        f"{path} is not a packed hf-domino data file (format {FORMAT_VERSION}): give a file `hf-domino pack` wrote, "
        "or the jsonl files of `hf-domino regenerate`."
    )


def _prompt_length(record: dict[str, Any], path: Path) -> int:
    """The prompt length of a record whose loss mask is zeros then ones (what regeneration writes)."""
    mask = record["loss_mask"]
    prompt_length = len(mask) - sum(mask)
    if len(mask) != len(record["input_ids"]) or any(mask[:prompt_length]) or not all(mask[prompt_length:]):
        raise InputDataError(
            f"{path}: the loss mask of {record_key(record)!r} is not zeros on the prompt, then ones on the response."
        )
    return prompt_length


def _recorded_recipe(paths: list[str | os.PathLike]) -> dict[str, Any]:
    recipes = [read_recipe(path) for path in paths]
    if any(recipe is None for recipe in recipes):
        missing = [str(path) for path, recipe in zip(paths, recipes) if recipe is None]
        expected = ", ".join(str(recipe_path(path)) for path in missing)
        raise InputDataError(
            f"No recipe recorded beside {', '.join(missing)} (`hf-domino regenerate` writes {expected}): pass "
            "`recipe=` (or `--recipe FILE`)."
        )
    if any(recipe_differences(recipes[0], recipe) for recipe in recipes[1:]):
        raise InputDataError(f"The files were regenerated with different recipes: pack them separately ({paths}).")
    return recipes[0]


def _counts(keys: list[Key], lengths: np.ndarray, prompt_lengths: np.ndarray) -> dict[str, Any]:
    responses = lengths - prompt_lengths
    sources = [key.split(":", 1)[0] if isinstance(key, str) else "index" for key in keys]
    examples, tokens = Counter(sources), Counter()
    for source, response in zip(sources, responses.tolist()):
        tokens[source] += response
    return {
        "examples": len(keys),
        "tokens": int(lengths.sum()),
        "response_tokens": int(responses.sum()),
        "by_source": {
            source: {"examples": examples[source], "response_tokens": tokens[source]} for source in examples
        },
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the `hf-domino pack` options."""
    parser.add_argument("--data", nargs="+", type=Path, required=True, help="jsonl files of `hf-domino regenerate`.")
    parser.add_argument("--output", type=Path, required=True, help=f"The {PACKED_SUFFIX} file to write.")
    parser.add_argument(
        "--recipe",
        type=Path,
        help="A JSON recipe to record, for --data regenerated without one (default: the out.recipe.json beside "
        "--data; those recorded must agree with it).",
    )


def _read_recipe_option(path: Path) -> dict[str, Any]:
    """`--recipe`: a JSON object, or an `InputDataError` naming the file."""
    try:
        recipe = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputDataError(f"--recipe {path} is not JSON ({error}): give a recipe like out.recipe.json.") from None
    if not isinstance(recipe, dict):
        raise InputDataError(f"--recipe {path} holds a {type(recipe).__name__}, not a JSON object (a recipe).")
    return recipe


def run(args: argparse.Namespace) -> int:
    """Run `hf-domino pack` with parsed arguments."""
    if args.output.suffix != PACKED_SUFFIX:
        raise SystemExit(f"--output must end with {PACKED_SUFFIX} (training reads packed files by that suffix).")
    if problem := output_problem(args.output):
        raise SystemExit(f"hf-domino pack: --output {args.output}: {problem}; give the path of a file to write.")
    recipe = _read_recipe_option(args.recipe) if args.recipe else None
    info = pack(args.data, args.output, recipe)
    counts = info["counts"]
    by_source = ", ".join(
        f"{name} {c['examples']} ({c['response_tokens']})" for name, c in counts["by_source"].items()
    )
    print(
        f"Packed {counts['examples']} examples, {counts['tokens']} tokens of which {counts['response_tokens']} in "
        f"responses, into {args.output} ({args.output.stat().st_size / 1e6:.2f} MB). Examples (response tokens) "
        f"per source: {by_source}."
    )
    return 0
