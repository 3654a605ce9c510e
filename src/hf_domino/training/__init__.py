"""Training Domino drafters against a frozen target (`hf-domino regenerate`, then `hf-domino train`).

The recipe is the Domino paper's (section 4.2, appendix A.1; docs/training.md): the target answers the training
prompts itself, the drafter learns many blocks per sequence in one forward, its Domino head is teacher-forced, and
a base-anchored curriculum mixes the base and final losses. One module per job, each readable on its own:

- `regenerate`: `hf-domino regenerate`, the target's answers to the prompts, as a resumable jsonl file;
- `packed`: `hf-domino pack`, the regenerated token ids in one compact file to commit (`pack`, `unpack`);
- `data`: examples from those files, the target's context features (in-process or `FeatureCache`), batches,
  anchors and block inputs;
- `loss`: the block attention mask, position weights, curriculum lambda, teacher-forced logits and the losses,
  wrapped in `DominoTrainingModule`;
- `loop`: `TrainConfig`, `train` (accelerate: CPU, GPU, DDP, FSDP) with bit-for-bit resumption, the warm start
  `init_from_target_layers`, the logged metrics;
- `run_folder`: a run's checkpoints, logs and settings, the checks that take a run up where another left off
  (`check_resumable`, `check_fresh_start`) and `clear_run`;
- `evaluate`: `teacher_forced_metrics`, `teacher_forced_acceptance` (generate()'s own blocks, teacher-forced),
  `evaluate_acceptance` (through `generate()`, counted by `hf_domino.acceptance` like the benchmark), `read_log`,
  `plot_loss_curves`;
- `command`: `hf-domino train` (argument parsing, building the drafter, `--eval-only`).
"""

from .data import (
    Batch,
    BlockInputs,
    Example,
    FeatureCache,
    build_block_inputs,
    collate,
    generate_chain,
    load_examples,
    sample_anchors,
    sample_chain_anchors,
    target_context_features,
    target_hidden_states,
)
from .evaluate import (
    AcceptanceResult,
    evaluate_acceptance,
    plot_loss_curves,
    read_log,
    teacher_forced_acceptance,
    teacher_forced_metrics,
)
from .loop import TrainConfig, init_from_target_layers, train
from .loss import (
    DominoLossOutput,
    DominoTrainingModule,
    accepted_lengths,
    block_attention_mask,
    curriculum_lambda,
    domino_losses,
    draft_logits,
    draft_vocab_index,
    position_weights,
    target_next_token_probs,
)
from .packed import pack, packed_info, unpack
from .run_folder import clear_run, latest_checkpoint

__all__ = [
    "AcceptanceResult",
    "Batch",
    "BlockInputs",
    "DominoLossOutput",
    "DominoTrainingModule",
    "Example",
    "FeatureCache",
    "TrainConfig",
    "accepted_lengths",
    "block_attention_mask",
    "build_block_inputs",
    "clear_run",
    "collate",
    "curriculum_lambda",
    "domino_losses",
    "draft_logits",
    "draft_vocab_index",
    "evaluate_acceptance",
    "generate_chain",
    "init_from_target_layers",
    "latest_checkpoint",
    "load_examples",
    "pack",
    "packed_info",
    "plot_loss_curves",
    "position_weights",
    "read_log",
    "sample_anchors",
    "sample_chain_anchors",
    "target_context_features",
    "target_hidden_states",
    "target_next_token_probs",
    "teacher_forced_acceptance",
    "teacher_forced_metrics",
    "train",
    "unpack",
]
