"""transformers >= 5.25 serves each model from a process of its own, started with pickled copies of the server's
`ModelLoader` and `GenerationState`. `hf-domino serve` hands it the subclasses here, so that the target loads ready to
draft and a continuously batched server runs the rows asked for.

transformers builds both itself (`Serve`), with the command line's settings, and calls the loader class's static
methods: these classes take the places of its own (`dense_gguf.patched_attribute`) while `configured(...)` gives each
object built meanwhile its settings, which then pickle with it. Imported only on such a transformers (its serving
extra installed): earlier releases load models in the server's own process (`serve.drafting_model_manager`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from transformers.cli.serving.model_manager import ModelLoader
from transformers.cli.serving.utils import GenerationState

from .serve import Drafting, located, with_rows

_CONFIGURATION: tuple[Drafting, dict[str, str]] | None = None


@contextlib.contextmanager
def configured(drafting: Drafting, folders: dict[str, str]) -> Iterator[None]:
    """Loaders and generation states built meanwhile take these settings (`folders`: `{Hub id: folder}`)."""
    global _CONFIGURATION
    _CONFIGURATION = (drafting, folders)
    try:
        yield
    finally:
        _CONFIGURATION = None


def _configuration() -> tuple[Drafting, dict[str, str]]:
    if _CONFIGURATION is None:
        raise RuntimeError("hf-domino's serving classes are built inside serve_loader.configured(...) only.")
    return _CONFIGURATION


class DraftingModelLoader(ModelLoader):
    """transformers' `ModelLoader` whose targets draft (`Drafting.ready`), and whose offline targets load from their
    converted folders while requests name them by their Hub ids. A drafter that does not fit a target is refused as
    the server reads the target's config (`load_config`), before its process starts."""

    def __init__(self, **loader_options: Any):
        super().__init__(**loader_options)
        self.drafting, self.folders = _configuration()

    def load_config(self, model_id: str) -> tuple[Any, Any]:
        config, generation_config = super().load_config(located(model_id, self.folders))
        self.drafting.check_target_config(model_id, config)
        return config, generation_config

    def load_processor(self, model_id: str) -> Any:
        return super().load_processor(located(model_id, self.folders))

    def _load_model(self, model_id: str, *args: Any, **kwargs: Any) -> Any:
        return self.drafting.ready(super()._load_model(located(model_id, self.folders), *args, **kwargs), model_id)


class BatchRowsGenerationState(GenerationState):
    """transformers' serving `GenerationState` whose continuous-batching config runs `Drafting.rows` requests together
    (`max_requests_per_batch`, which `transformers serve` has no option for)."""

    def __init__(self, *args: Any, cb_config: Any = None, **kwargs: Any):
        rows = _configuration()[0].rows
        super().__init__(*args, cb_config=cb_config if rows is None else with_rows(cb_config, rows), **kwargs)
