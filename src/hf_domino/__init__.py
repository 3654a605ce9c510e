"""hf-domino: Domino speculative-decoding drafters for Hugging Face transformers.

Importing this package registers `DominoConfig`/`DominoForSpeculation` with the Auto classes and installs the
`generate(assistant_model=drafter)` hook (see `hf_domino.generate_hook_domino`).
"""

import importlib

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .attached_drafter_domino import attach_drafter, attached_drafter, detach_drafter
from .batching_manager_domino import release_openmp_workers
from .configuration_domino import DominoConfig, default_target_layer_ids
from .cpu_fast_path import CpuFastPathReport, prepare_for_cpu_decoding
from .generate_hook_domino import install_assisted_generation_hook
from .generation_domino import DominoCandidateGenerator
from .modeling_domino import DominoForSpeculation, TargetModules
from .options_domino import DominoGenerationStats, DominoOptions, check_drafter_for_target
from .transformers_dflash import from_transformers_dflash, to_transformers_dflash

install_assisted_generation_hook()  # also done by every drafter's __init__; here so that the hook is in place early
AutoConfig.register(DominoConfig.model_type, DominoConfig, exist_ok=True)
AutoModel.register(DominoConfig, DominoForSpeculation, exist_ok=True)
AutoModelForCausalLM.register(DominoConfig, DominoForSpeculation, exist_ok=True)
# pipeline(..., assistant_model="path/to/drafter") resolves the assistant's class by looking the config's
# `architectures` names up in `importlib.import_module("transformers")`; expose ours there so a path string works.
# That must be the module object now in sys.modules: the first import of `transformers.processing_utils` (pulled in
# by any model code, ours included) re-executes transformers' __init__ and replaces sys.modules["transformers"], so
# the `transformers` bound above may be a stale object that the pipeline never sees.
importlib.import_module("transformers.processing_utils")
importlib.import_module("transformers").DominoForSpeculation = DominoForSpeculation

__version__ = "0.1.0"

__all__ = [
    "CpuFastPathReport",
    "DominoCandidateGenerator",
    "DominoConfig",
    "DominoForSpeculation",
    "DominoGenerationStats",
    "DominoOptions",
    "TargetModules",
    "attach_drafter",
    "attached_drafter",
    "check_drafter_for_target",
    "default_target_layer_ids",
    "detach_drafter",
    "from_transformers_dflash",
    "prepare_for_cpu_decoding",
    "release_openmp_workers",
    "to_transformers_dflash",
]
