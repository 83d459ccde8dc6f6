"""Build the tiny random-weight Llama the `vllm` tier serves: offline, seeded, byte-identical.

Run it with the vLLM venv's Python (it needs torch, safetensors and tokenizers, which only that
venv has): ``$VLLM_VENV/bin/python tests/vllm_tier/tinymodel.py OUT_DIR``. About 5-9 s on the
project's 2-core machine, 2.9 MB on disk.

The shapes are those measured to work on vLLM 0.32's CPU
attention backend (hidden 128, 2 layers, 4 heads, 2 KV heads, head_dim 32: 512 bytes of KV per
token in bf16, so ``--num-gpu-blocks-override 32`` is a 4,096-token pool). The weights are
random: the model emits noise, which is all a test of the server around it needs.

Reproducible on purpose, so a cached copy can be trusted and a failure can be rebuilt:

* the tokenizer's training text is generated from a fixed seed (not read from the machine, whose
  stdlib differs between Python builds), and training runs on one thread;
* the weights come from a seeded ``torch.Generator`` in a fixed parameter order and are written
  with ``safetensors`` directly (no ``transformers`` init code whose RNG use changes between
  releases);
* every JSON file is written by this script with sorted keys.

``MANIFEST.json`` lists each file's sha256; the tier checks a second build against it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from pathlib import Path

# One thread: tokenizers' parallel BPE trainer must not depend on the core count, and the
# machine is shared with whatever else CI runs.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SEED = 20261122
VOCAB = 4096
HIDDEN = 128
INTERMEDIATE = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
MAX_POSITIONS = 4096
SPECIALS = ("<s>", "</s>", "<unk>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>")
BOS, EOS, UNK, PAD = 0, 1, 2, 3
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_SYLLABLES = [
    "ka",
    "to",
    "ri",
    "mo",
    "na",
    "el",
    "an",
    "or",
    "is",
    "us",
    "er",
    "at",
    "ing",
    "ed",
    "ly",
    "un",
    "re",
    "in",
    "de",
    "pro",
    "con",
    "ver",
    "ter",
    "pre",
    "ex",
    "ma",
    "lo",
    "sa",
    "vi",
    "po",
    "qu",
    "th",
    "sh",
    "ch",
    "st",
    "tr",
    "pl",
    "gr",
    "fl",
    "br",
    "cl",
]
_PUNCT = (".", ",", ";", ":", "!", "?", "(", ")", "-", "'", '"', "0", "1", "2", "7", "\n")


def corpus(n_words: int = 120_000) -> str:
    """Pseudo-words from a fixed seed; stable across Python versions (random.Random(int))."""
    rnd = random.Random(SEED)
    out: list[str] = []
    for _ in range(n_words):
        word = "".join(rnd.choice(_SYLLABLES) for _ in range(rnd.randint(1, 4)))
        if rnd.random() < 0.1:
            word = word.capitalize()
        if rnd.random() < 0.15:
            word += rnd.choice(_PUNCT)
        out.append(word)
    return " ".join(out)


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # Byte-level: every byte string encodes, so no prompt can fail on an unknown character.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus().split("\n"), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)]
    )
    (out / "tokenizer.json").write_text(tok.to_str(pretty=False))
    _json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": "<pad>",
            "model_max_length": MAX_POSITIONS,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _json(
        out / "special_tokens_map.json",
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"},
    )
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def build_weights(out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(SEED)
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN)),
            (p + "self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
            (p + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM)),
            (p + "mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
            (p + "mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
        ]
    shapes += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    tensors = {}
    for name, shape in shapes:
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        else:
            t = torch.empty(shape).normal_(0.0, 0.02, generator=gen)
        tensors[name] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _json(
        out / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": VOCAB,
            "hidden_size": HIDDEN,
            "intermediate_size": INTERMEDIATE,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "max_position_embeddings": MAX_POSITIONS,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "bos_token_id": BOS,
            "eos_token_id": EOS,
            "pad_token_id": PAD,
            "torch_dtype": "bfloat16",
            "initializer_range": 0.02,
        },
    )
    _json(
        out / "generation_config.json",
        {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD, "do_sample": False},
    )


def _json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def manifest(out: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.iterdir())
        if p.is_file() and p.name != "MANIFEST.json"
    }


def build(out: Path) -> dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    build_weights(out)
    digests = manifest(out)
    _json(out / "MANIFEST.json", digests)
    return digests


# The long-context variant (``--long-context``): room for a 20,480-token prompt, and wider and
# deeper so that its prefill, in small chunks, takes seconds and many engine steps on two CPU
# cores (capture_progress.py, test_vllm_progress.py): 23 M parameters, 46 MB. Same tokenizer,
# same seed.
LONG_CONTEXT = {
    "HIDDEN": 512,
    "INTERMEDIATE": 1024,
    "LAYERS": 8,
    "HEADS": 8,
    "KV_HEADS": 4,
    "HEAD_DIM": 64,
    "MAX_POSITIONS": 32768,
}


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[1:] == ["--long-context"]:
        globals().update(LONG_CONTEXT)
        args = args[:1]
    if len(args) != 1:
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR [--long-context]")
    build(Path(args[0]))
