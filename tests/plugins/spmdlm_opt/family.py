"""The `Family` that plugs OPT into spmdlm, registered from outside the package under the `spmdlm.families` entry
point group (`opt = spmdlm_opt.family:FAMILY`): causal LM on `--block_size` blocks, exported for transformers'
`OPTForCausalLM`. Its presets are the JSON files of the package's presets/ folder. Nothing under spmdlm/ names it."""

from __future__ import annotations

from spmdlm.data.objectives import DOCUMENT_ATTENTION
from spmdlm.data.objectives.clm import BLOCK_SIZE, CausalLM
from spmdlm.data.tokenization import TokenizerSpec, special_token_ids
from spmdlm.errors import ArgumentError
from spmdlm.families.base import Family, Generation, forward_single_stack
from spmdlm_opt import TABLE, OPTConfig, OPTForCausalLM, check_hf_config, forward_flops


def build_objective(flags, config, tokenizer) -> CausalLM:
    # </s> starts documents, as GPT-2's <|endoftext|>: with --document_attention isolated a segment begins at each
    return CausalLM(
        block_size(flags, config),
        eos_id=special_token_ids(tokenizer, FAMILY.tokenizer)["eos"],
        document_attention=DOCUMENT_ATTENTION.of(flags),
    )


def block_size(flags, config) -> int:
    return BLOCK_SIZE.of(flags) or min(1024, config.max_position_embeddings)


def check_lengths(flags, config) -> None:
    if block_size(flags, config) > config.max_position_embeddings:
        raise ArgumentError(
            f"--block_size {block_size(flags, config)} is longer than the model's "
            f"max_position_embeddings {config.max_position_embeddings}; lower --block_size"
        )


FAMILY = Family(
    name="opt",
    config_class=OPTConfig,
    model_class=OPTForCausalLM,
    hf_auto_class="AutoModelForCausalLM",
    table=TABLE,
    # OPT's byte-level BPE: </s> starts and ends documents, <pad> pads; no <s> framing
    tokenizer=TokenizerSpec(
        kind="bpe",
        specials={"bos": "</s>", "eos": "</s>", "unk": "<unk>", "pad": "<pad>", "mask": None},
        trained_order=("<pad>", "</s>", "<unk>"),
    ),
    objective_class=CausalLM,
    default_preset="opt-tiny",
    quickstart=dict(
        output_dir="runs/opt-tiny-stdlib",
        config_name="opt-tiny",
        block_size=64,
        per_device_train_batch_size=4,
        learning_rate=2e-3,
        max_steps=100,
    ),
    check_lengths=check_lengths,
    build_objective=build_objective,
    forward_flops=forward_flops,
    forward=forward_single_stack,
    generation=Generation.NONE,  # no KV cache: trained and exported only
    check_hf_config=check_hf_config,
)
