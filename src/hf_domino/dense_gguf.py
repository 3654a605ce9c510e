"""A GGUF checkpoint as a dense transformers model and tokenizer, de-quantized once and kept.

Converting a GGUF file takes 20-30 s for a 135M-parameter model on a small CPU (the tokenizer alone 5-10 s), more than
a short generation. The first load keeps the float32 model and its tokenizer as a plain `save_pretrained` folder in
`dense_gguf_cache`; later loads read that in a fraction of a second, the same weights (the offline targets of
`assets.load_target` load through here).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class MissingPackageError(ModuleNotFoundError):
    """A PyPI package whose files (a model, a prompt set) or code a command needs is not installed; the message names
    the `pip install` that fixes it."""


def cache_root() -> Path:
    """Where this package keeps what it derives once from installed files: `$HF_DOMINO_CACHE`, else
    `~/.cache/hf_domino`."""
    return Path(os.environ.get("HF_DOMINO_CACHE") or Path.home() / ".cache" / "hf_domino")


def dense_gguf_cache(gguf_path: Path) -> Path:
    """The folder that keeps a GGUF checkpoint's de-quantized float32 model and its tokenizer (`save_pretrained`'s
    files), under `cache_root()`. Its name changes with the file (size and modification time) and with the
    transformers version that converted it, so an upgrade of either converts anew instead of reading a stale copy."""
    import transformers

    stat = gguf_path.stat()
    key = f"{stat.st_size}-{stat.st_mtime_ns}-transformers{transformers.__version__}"
    return cache_root() / "dense" / f"{gguf_path.stem}-{key}"


def load_dense_gguf(
    gguf_path: Path, dtype: torch.dtype | None = None, pip_install: str = "gguf", *, cache: bool = True
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A GGUF checkpoint's model, de-quantized to `dtype` (float32 by default) in eval mode, and its tokenizer; read
    from `dense_gguf_cache` when an earlier load left it there (with `cache`), else converted and, with `cache`,
    written there for the next load."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    cached = dense_gguf_cache(gguf_path) if cache else None
    if cached is not None and cached.is_dir():
        remove_stale_partials(cached)  # left by a write killed beside a copy another process finished
        tokenizer = AutoTokenizer.from_pretrained(cached)
        with _no_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
    else:
        model, tokenizer = _dequantized_gguf(gguf_path, torch.float32 if cached else dtype, pip_install)
        if cached is not None:
            _write_dense_cache(model, tokenizer, cached)
            model = model.to(dtype)
    # The same model whichever way it was loaded: named after the GGUF file's folder, as a plain load names it.
    model.config._name_or_path = str(gguf_path.parent)
    return model.eval(), tokenizer


def dense_gguf_folder(gguf_path: Path, pip_install: str = "gguf") -> Path:
    """`dense_gguf_cache(gguf_path)`, converted there first where no load has yet: a folder any
    `from_pretrained` reads (a server's model processes load the model from it)."""
    folder = dense_gguf_cache(gguf_path)
    if not folder.is_dir():
        load_dense_gguf(gguf_path, pip_install=pip_install)
    if not folder.is_dir():  # the cache could not be written (warned): there is no folder to read
        raise FileNotFoundError(
            f"No de-quantized copy of {gguf_path.name} could be written at {folder}: set HF_DOMINO_CACHE to a "
            "writable folder."
        )
    return folder


def _dequantized_gguf(
    gguf_path: Path, dtype: torch.dtype, pip_install: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise MissingPackageError(
            f"Reading the GGUF checkpoint {gguf_path.name} needs the `gguf` package: `pip install {pip_install}`.",
            name="gguf",
        )
    # transformers >= 5.24 keeps a GGUF file's weights packed when the `kernels` package has a matmul for them. The
    # target of this project is the dequantized dense model: the drafter was trained on its features, and the CPU fast
    # path packs its nn.Linear layers. Older versions always dequantize (and have no GgufConfig).
    dense = {}
    if hasattr(transformers, "GgufConfig"):
        dense["quantization_config"] = transformers.GgufConfig(gguf_file=gguf_path.name, dequantize=True)
    with _quiet_gguf_loading():
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=dtype, **dense)
    # Older versions mark the model as GGUF-quantized although its weights are dense; without the marks it is a plain
    # model that `save_pretrained` can write.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def remove_stale_partials(path: Path) -> None:
    """Removes what writes of `path` killed outright (SIGKILL, power) left beside it (`.<name>.partial-*` folders,
    `<name>.partial-*` files): one untouched for an hour is no live write."""
    for stale in [*path.parent.glob(f".{path.name}.partial-*"), *path.parent.glob(f"{path.name}.partial-*")]:
        try:
            if time.time() - stale.stat().st_mtime > 3600:
                shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
        except OSError:  # another process removed it first
            pass


def _write_dense_cache(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """Write the model and tokenizer to `folder` whole or not at all: into a temporary folder beside it, renamed into
    place once complete. Another process that got there first wins; a cache that cannot be written (a read-only or
    full disk) is skipped with a warning, since it only saves time."""
    partial = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(folder)
        # mkdir (not mkdtemp, which makes it private) so that the umask decides, as for the rest of the cache.
        partial = folder.with_name(f".{folder.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        partial.mkdir()
        with _no_progress_bars():
            model.save_pretrained(partial)
            tokenizer.save_pretrained(partial)
        partial.rename(folder)
        partial = None
    except OSError as error:
        if not folder.is_dir():
            warnings.warn(
                f"Could not keep the de-quantized model in {folder} ({error}); the next load converts the GGUF file "
                "again. Set HF_DOMINO_CACHE to a writable folder to keep it.",
                stacklevel=3,
            )
    finally:
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)


def load_dense_gguf_tokenizer(gguf_path: Path) -> PreTrainedTokenizerBase:
    """A GGUF checkpoint's tokenizer alone: from `dense_gguf_cache` when a load left it there (a fraction of a second),
    else from the GGUF file (5-10 s on a small CPU)."""
    from transformers import AutoTokenizer

    if dense_gguf_cache(gguf_path).is_dir():
        return AutoTokenizer.from_pretrained(dense_gguf_cache(gguf_path))
    with _quiet_gguf_loading():
        return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@contextlib.contextmanager
def _quiet_gguf_loading() -> Iterator[None]:
    """Silence the progress bars printed while a GGUF checkpoint is de-quantized, for this block only."""
    from transformers import modeling_gguf_pytorch_utils

    # The de-quantization loop uses plain `tqdm`, which transformers' progress bar switch does not reach.
    gguf_tqdm = getattr(modeling_gguf_pytorch_utils, "tqdm", None)
    silence_gguf = (
        patched_attribute(modeling_gguf_pytorch_utils, "tqdm", functools.partial(gguf_tqdm, disable=True))
        if gguf_tqdm is not None
        else contextlib.nullcontext()
    )
    with _no_progress_bars(), silence_gguf:
        yield


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars (loading and writing weights) off for this block only."""
    from transformers.utils import logging

    bars_were_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars_were_enabled:
            logging.enable_progress_bar()


@contextlib.contextmanager
def patched_attribute(owner: Any, name: str, value: Any) -> Iterator[None]:
    """`owner.name` is `value` inside the block: for library code that reads a module attribute and takes no
    argument for it (transformers' GGUF loader's progress bar, `transformers serve`'s model manager)."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)
