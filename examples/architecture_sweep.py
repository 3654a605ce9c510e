"""Every causal-LM family of the installed transformers as a target, tiny and random: served, refused or broken.

For each model type that `AutoModelForCausalLM` maps (encoder and encoder-decoder families left out), a tiny model is
built from its config with small generic sizes, its weights scaled up so that greedy choices depend on every layer,
and a drafter of random weights sized for it by `DominoConfig.from_target`. Then, greedy, the target alone and
`generate()` with the drafter (fixed policy, 4 drafts per cycle, mostly rejected), for one sequence (also with the
default policy, which times verifications on the family's cache, and on a static cache, where it is not refused),
for a left-padded batch of two, for that batch with columns its mask leaves out inside the rows (padding inside a
sequence), for the batch's scores and hidden states per step (`output_scores`, `output_hidden_states`: each within
`TOLERANCE` of the target alone's, relative to the largest), for the batch's next turn, drafted on the cache its
drafted first turn left (as a chat continues it) against the target alone continuing its own, and for requests
served by `generate_batch` two rows at a time, joining as others finish, against each prompt alone. One line per
family:

- `ok`: token-identical to the target alone, one sequence and batches (`batch refused: ...` where only batches are);
- `refused: ...`: a ValueError that names what drafting cannot serve for it;
- `MISMATCH` or `error: ...`: an output that differs from the target alone's, or another exception in a call with
  the drafter: a defect of ours (the exit status is 1);
- `not built: ...` / `target alone failed: ...`: the generic tiny sizes do not fit that family's config (its own
  tests, tests/test_architectures.py and tests/test_recurrent_targets.py, size it by hand), nothing about drafting;
  `timed out`: the family took longer than `--seconds`.

Run it when transformers releases: a new family shows up here before a user meets it (docs/usage.md, "Which
targets", quotes a run).

    python examples/architecture_sweep.py                        # every family: about 10 minutes on 2 cores
    python examples/architecture_sweep.py gemma4_text gpt_oss    # some
"""

from __future__ import annotations

import argparse
import signal
import sys
import warnings

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hf_domino import DominoConfig, DominoForSpeculation
from hf_domino.cache_domino import cache_argument

# Encoders used as decoders, encoder-decoders' decoders, models whose inputs are not token ids alone, and GPT-1,
# which keeps no key/value cache (transformers' assisted loop fails on it with any assistant).
NOT_DECODER_LMS = set(
    "bart bert bert-generation big_bird bigbird_pegasus blenderbot blenderbot-small blt camembert cpmant ctrl "
    "data2vec-text electra ernie fuyu git got_ocr2 marian mbart megatron-bert mllama moshi musicgen musicgen_melody "
    "mvp pegasus phi4_multimodal plbart prophetnet reformer rembert roberta roberta-prelayernorm roc_bert roformer "
    "trocr whisper xlm xlm-roberta xlm-roberta-xl xlnet xmod openai-gpt emu3".split()
)
# Small sizes under every name the families give them; a config takes those it has (windows, attention chunks and
# Llama 4's temperature floor short enough to be passed within the outputs).
SIZES = dict(
    vocab_size=64, hidden_size=32, n_embd=32, d_model=32, intermediate_size=64, ffn_dim=64, num_hidden_layers=4,
    n_layer=4, num_attention_heads=4, n_head=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
    n_positions=256, num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    moe_k=2, moe_topk=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, n_group=1, topk_group=1,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_num_heads=4, linear_head_dim=8, index_n_heads=16, index_head_dim=8, index_topk=8, sliding_window=8,
    sliding_window_size=8, unpadded_vocab_size=64, attention_chunk_size=8, floor_scale=8,
    tie_word_embeddings=False, pad_token_id=0, bos_token_id=2, eos_token_id=1,
)  # fmt: skip
# Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash, MiniCPM3, ...): one key/value head per query head.
LATENT_ATTENTION = dict(num_key_value_heads=4, head_dim=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4,
                        qk_nope_head_dim=8, v_head_dim=8)  # fmt: skip
PROMPT = [5, 9, 12, 7, 30, 5, 9, 12, 7, 30, 5, 9, 12, 40, 41, 42, 5, 9]
ROWS = [[11, 5, 9, 12, 7, 5, 9, 12], [5, 9, 12, 7, 30, 5, 9, 12, 7, 30, 22]]
GREEDY = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}
FIXED = {"draft_policy": "fixed", "num_speculative_tokens": 4}
# Scores and hidden states of tiny models with scaled-up weights, read off forwards over several tokens (a verification)
# or one: fp32 rounding of the two summation orders, relative to the largest value of the step.
TOLERANCE = 1e-3


class TimedOut(BaseException):  # not an Exception: no family's own failure may swallow it
    pass


def tiny_config(config_class: type[transformers.PretrainedConfig]) -> transformers.PretrainedConfig:
    """The config with the small sizes it has fields for, its sub-configs (text, vision, audio) small too: else a
    vision-language family would build its full-size towers."""
    default = config_class()
    fields = default.to_dict()
    sizes = {**SIZES, **LATENT_ATTENTION} if "kv_lora_rank" in fields else SIZES
    small = {name: value for name, value in sizes.items() if name in fields}
    for name in getattr(config_class, "sub_configs", {}):
        if isinstance(sub_config := getattr(default, name, None), transformers.PretrainedConfig):
            small[name] = tiny_config(type(sub_config)).to_dict()
    return config_class(**small)


def tiny_target(model_type: str) -> transformers.PreTrainedModel:
    model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    torch.manual_seed(0)
    # A multimodal family's type maps to its text model (Qwen3.5, Llama 4), which takes the text config
    config = tiny_config(getattr(model_class, "config_class", None) or CONFIG_MAPPING[model_type])
    target = model_class(config).eval()
    with torch.no_grad():
        for param in target.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.3)
    return target


def random_drafter(target: transformers.PreTrainedModel) -> DominoForSpeculation:
    config = DominoConfig.from_target(target.config, num_hidden_layers=2, block_size=6, mask_token_id=0, emb_dim=8,
                                      gru_hidden_dim=16)  # fmt: skip
    torch.manual_seed(1)
    drafter = DominoForSpeculation(config).eval()
    with torch.no_grad():
        for param in drafter.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.5)
    return drafter


def left_padded(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    width = max(map(len, rows))
    return {
        "input_ids": torch.tensor([[0] * (width - len(row)) + row for row in rows]),
        "attention_mask": torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows]),
    }


def with_gaps(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`left_padded(ROWS)` with columns its mask leaves out inside each row, as padding inside a sequence."""
    mask = batch["attention_mask"].clone()
    mask[0, -6:-4], mask[1, 3] = 0, 0
    return {**batch, "attention_mask": mask}


def drafted_as_alone(target, drafter, inputs: dict, new_tokens: int, options: dict = FIXED, **call) -> str | None:
    """None where generate() with the drafter (and `options`) gives the target alone's tokens, else what happened
    (None too where the target alone cannot run the `call`, a static cache say)."""
    try:
        expected = target.generate(**inputs, max_new_tokens=new_tokens, **GREEDY, **call)
    except Exception:
        if not call:
            raise
        return None
    try:
        output = target.generate(**inputs, max_new_tokens=new_tokens, assistant_model=drafter, **GREEDY, **options,
                                 **call)  # fmt: skip
    except ValueError as refusal:
        return f"refused: {' '.join(str(refusal).split())}"
    return None if torch.equal(output, expected) else "MISMATCH"


def one_sequence_as_alone(target, drafter) -> str | None:
    """One sequence: the fixed policy, then the default one (which times verifications on the family's cache), then
    on a static cache (where refused, one sequence is still served on the dynamic one)."""
    prompt = {"input_ids": torch.tensor([PROMPT])}
    one = drafted_as_alone(target, drafter, prompt, 24)
    if one is None:
        default = drafted_as_alone(target, drafter, prompt, 24, options={})
        one = None if default is None else f"{default} with the default policy"
    if one is None:
        static = drafted_as_alone(target, drafter, prompt, 24, cache_implementation="static")
        one = None if static is None or static.startswith("refused") else f"{static} on a static cache"
    return one


def outputs_as_alone(target, drafter, inputs: dict, new_tokens: int) -> str | None:
    """None where a batch's scores and hidden states per step, with the drafter, are the target alone's (within
    `TOLERANCE`), else what differs; None too where the call with the drafter refuses them (the refusal names why)."""
    returned = {"return_dict_in_generate": True, "output_scores": True, "output_hidden_states": True}
    expected = target.generate(**inputs, max_new_tokens=new_tokens, **GREEDY, **returned)
    try:
        output = target.generate(**inputs, max_new_tokens=new_tokens, assistant_model=drafter, **GREEDY, **FIXED,
                                 **returned)  # fmt: skip
    except ValueError:
        return None
    steps = [(output.scores, expected.scores, "scores")]
    steps += [(ours, theirs, f"hidden states of column {i}")
              for i, (ours, theirs) in enumerate(zip(output.hidden_states, expected.hidden_states))]  # fmt: skip
    for ours, theirs, what in steps:
        for mine, alone in zip(ours, theirs, strict=True):
            scale = float(alone.abs().max()) or 1.0
            if mine.shape != alone.shape or float((mine - alone).abs().max()) > TOLERANCE * scale:
                return f"MISMATCH of its {what}"
    return None


def next_turn_as_alone(target, drafter, batch: dict, new_tokens: int) -> str | None:
    """None where a batch's next turn, drafted on the cache its drafted first turn left, gives the target alone's
    tokens continuing its own cache (None too where the target alone cannot continue its cache), else what
    happened."""
    outputs = []
    for assistant in ({}, {"assistant_model": drafter, **FIXED}):
        cache = transformers.DynamicCache(config=target.config)
        first = target.generate(**batch, max_new_tokens=new_tokens, **GREEDY, **assistant, **cache_argument(cache))
        rows, answers = first.shape[0], first.shape[1] - batch["input_ids"].shape[1]
        turn = {
            "input_ids": torch.cat([first, torch.tensor([[5, 9, 12]] * rows)], dim=-1),
            "attention_mask": torch.cat(
                [batch["attention_mask"], torch.ones(rows, answers + 3, dtype=torch.long)], -1
            ),
        }
        try:
            outputs.append(target.generate(**turn, max_new_tokens=8, **GREEDY, **assistant, **cache_argument(cache)))
        except ValueError as refusal:
            if not assistant:
                return None
            return f"refused: {' '.join(str(refusal).split())}"
        except Exception:
            if not assistant:
                return None
            raise
    return None if torch.equal(*outputs) else "MISMATCH"


def requests_as_alone(target, drafter, new_tokens: int) -> str | None:
    """None where `generate_batch` with the drafter, requests joining two rows at a time as others finish, gives each
    request the target alone's tokens for its prompt, else what happened."""
    prompts = [ROWS[0], PROMPT, ROWS[1]]
    expected = [
        target.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, **GREEDY)[0, len(prompt) :].tolist()
        for prompt in prompts
    ]
    rows = transformers.ContinuousBatchingConfig(max_requests_per_batch=2)
    try:
        results = target.generate_batch(prompts, assistant_model=drafter, max_new_tokens=new_tokens,
                                        continuous_batching_config=rows, **GREEDY, **FIXED)  # fmt: skip
    except ValueError as refusal:
        return f"refused: {' '.join(str(refusal).split())}"
    return None if [result.generated_tokens for result in results.values()] == expected else "MISMATCH"


def check_family(model_type: str) -> str:
    try:
        target = tiny_target(model_type)
    except Exception as error:  # the generic sizes do not fit this config
        return f"not built: {type(error).__name__}"
    try:
        target.generate(torch.tensor([PROMPT]), max_new_tokens=2, **GREEDY)
    except Exception as error:
        return f"target alone failed: {type(error).__name__}"
    try:
        drafter = random_drafter(target)
        one = one_sequence_as_alone(target, drafter)
        if one is not None:
            return one
        batch = drafted_as_alone(target, drafter, left_padded(ROWS), 20)
        if batch is None:
            gaps = drafted_as_alone(target, drafter, with_gaps(left_padded(ROWS)), 20)
            batch = None if gaps is None else f"with columns left out inside rows {gaps}"
        if batch is None:
            batch = outputs_as_alone(target, drafter, left_padded(ROWS), 20)
        if batch is None:
            turn = next_turn_as_alone(target, drafter, left_padded(ROWS), 20)
            batch = None if turn is None else f"'s next turn on its cache {turn}"
        if batch is None:
            requests = requests_as_alone(target, drafter, 20)
            batch = None if requests is None else f"'s requests (generate_batch) {requests}"
    except Exception as error:
        return f"error: {type(error).__name__}: {' '.join(str(error).split())}"
    return "ok" if batch is None else f"ok, batch {batch}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_types", nargs="*", help="model types to check (default: every causal LM)")
    parser.add_argument("--seconds", type=int, default=120, help="per family, building included")
    parser.add_argument("--width", type=int, default=160, help="characters per line")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(2)

    def stop(*_):
        raise TimedOut

    signal.signal(signal.SIGALRM, stop)
    model_types = args.model_types or sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - NOT_DECODER_LMS)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: {len(model_types)} families")
    defects = 0
    for model_type in model_types:
        signal.alarm(args.seconds)
        try:
            outcome = check_family(model_type)
        except TimedOut:
            outcome = f"timed out after {args.seconds} s"
        finally:
            signal.alarm(0)
        defects += outcome.startswith(("MISMATCH", "error")) or "MISMATCH" in outcome
        print(f"{model_type:26s} {outcome}"[: args.width], flush=True)
    print(f"{defects} defects")
    return 1 if defects else 0


if __name__ == "__main__":
    sys.exit(main())
