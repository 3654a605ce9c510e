"""hf-domino: Domino speculative-decoding drafters for Hugging Face transformers.

Importing this package registers `DominoConfig`/`DominoForSpeculation` with the Auto classes and installs the
`generate(assistant_model=drafter)` hook (see `hf_domino.generation_domino`).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_domino import DominoConfig, default_target_layer_ids
from .generation_domino import DominoCandidateGenerator, DominoGenerationStats, check_drafter_for_target
from .modeling_domino import DominoForSpeculation, TargetModules

AutoConfig.register(DominoConfig.model_type, DominoConfig, exist_ok=True)
AutoModel.register(DominoConfig, DominoForSpeculation, exist_ok=True)
# pipeline("text-generation", assistant_model="path/to/drafter") loads the assistant through the task's Auto class.
AutoModelForCausalLM.register(DominoConfig, DominoForSpeculation, exist_ok=True)

__version__ = "0.1.0"

__all__ = [
    "DominoCandidateGenerator",
    "DominoConfig",
    "DominoForSpeculation",
    "DominoGenerationStats",
    "TargetModules",
    "check_drafter_for_target",
    "default_target_layer_ids",
]
