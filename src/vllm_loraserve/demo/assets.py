"""Deterministic demo assets: a tokenizer trained here, a tiny causal LM with
random weights, and PEFT LoRA adapters of several ranks. No hub, no network.

Layout written by `build_assets(out_dir)`:

    out_dir/model/        config.json, model.safetensors, tokenizer files
    out_dir/adapters/<name>/   adapter_config.json, adapter_model.safetensors
    out_dir/adapters.json      [{"name", "rank", "alpha", "target_modules", "path"}]

Same arguments, same bytes: every random draw comes from a seeded generator.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from vllm_loraserve.adapters.peft import short_name, write_adapter

DEMO_RANKS = (8, 16, 32, 64, 128)
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EMBEDDING_TARGETS = ("embed_tokens",)  # the input embedding's name in Llama and Qwen2
SPECIAL_TOKENS = [
    "<|pad|>", "<|unk|>", "<|begin|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Training text for the tokenizer. Content only shapes which merges exist.
_CORPUS = """\
A language model reads a prompt one token at a time and writes an answer.
Serving many fine tuned variants of one model is cheap when each variant is a
low rank adapter: two thin matrices per layer instead of a full copy of the
weights. The server keeps the base model once and applies the adapter of each
request inside the same batch. Ranks differ: eight, sixteen, thirty two, sixty
four and one hundred twenty eight. A small rank is fast and a large rank is
expressive. Pages of memory hold both the key value cache and the adapters, so
nothing is wasted on padding. When an adapter is cold it is copied from the
host while the processor computes its first layers. The scheduler looks at the
queue, the ranks and the deadlines, and picks the next batch. A router in front
of several engines sends each request to a server that holds its adapter and
moves adapters when demand drifts. What is the weather like today? Tell me a
story about a cat who learned to sail. Summarise the following text in one
sentence. Translate this sentence into French. Write a poem about the sea.
Explain how a transformer works to a child. List three colours: red, green and
blue. Numbers: zero one two three four five six seven eight nine ten eleven
twelve. The quick brown fox jumps over the lazy dog. Hello, how are you? I am
fine, thank you. Please answer briefly. def add(a, b): return a + b
for i in range(10): print(i * i) if x > 0: y = x else: y = -x
"""


@dataclass(frozen=True)
class ModelPreset:
    arch: str  # "llama" or "qwen2"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int | None  # None: the trained tokenizer's size
    write_weights: bool  # False: config only, serve with --load-format dummy


PRESETS = {
    "tiny": ModelPreset("llama", 128, 384, 4, 4, 2, None, True),
    "tiny-qwen2": ModelPreset("qwen2", 128, 384, 2, 4, 2, None, True),
    # Small enough for an fp32 HF reference, large enough for real GPU tiles.
    "small": ModelPreset("llama", 512, 1536, 4, 8, 4, None, True),
    # Two layers of Llama-3-8B (GQA 32/8, intermediate 14336), for the GPU
    # test of the shapes users serve (all-linear adapters).
    "llama3-8b-layers": ModelPreset("llama", 4096, 14336, 2, 32, 8, None, True),
    # Llama at ~1.1B for the GPU smoke test (../shared/device recipe's shape).
    "llama-1b": ModelPreset("llama", 2048, 5632, 16, 32, 8, 32000, False),
}


def _untrained_tokenizer(arch: str):
    """An empty BPE tokenizer with the text pipeline (normalizer,
    pre-tokenizer, decoder) that `AutoTokenizer` uses for `arch`.

    transformers 5.x ignores the pipeline of a `qwen2` model's
    tokenizer.json: `AutoTokenizer` builds `Qwen2Tokenizer` from its vocab and
    merges alone, with Qwen2's byte-level pipeline. So a Qwen2 tokenizer is
    trained with that very pipeline (taken from `Qwen2Tokenizer`, not copied),
    and tokenizes the same whichever way it is loaded (a random Qwen2 may emit
    a lone byte of a multi-byte character: it decodes to U+FFFD). Llama's tokenizer.json
    is loaded as written: Metaspace (as SentencePiece) makes every token decode
    to whole characters, so a random model's output is still printable text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if arch == "qwen2":
        from transformers import Qwen2Tokenizer

        pipeline = Qwen2Tokenizer().backend_tokenizer
        tok = Tokenizer(models.BPE())
        tok.normalizer = pipeline.normalizer
        tok.pre_tokenizer = pipeline.pre_tokenizer
        tok.decoder = pipeline.decoder
        return tok, pre_tokenizers.ByteLevel.alphabet()  # every byte: no <unk> at all
    tok = Tokenizer(models.BPE(unk_token="<|unk|>"))
    # "first": no space is made up after a special token (as Llama's own)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    return tok, ["\t", "\n", *map(chr, range(32, 127))]  # no <unk> for ASCII text


def build_tokenizer(out_dir: str, vocab_size: int | None = None, arch: str = "llama") -> int:
    """Train a BPE tokenizer on `_CORPUS` for a model of `arch`; returns its
    vocab size.

    With `vocab_size`, filler tokens pad it to exactly that size: every id a
    model of that vocabulary can emit must decode (vLLM detokenizes each).
    """
    from tokenizers import trainers
    from transformers import PreTrainedTokenizerFast

    tok, alphabet = _untrained_tokenizer(arch)
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        chat_template=CHAT_TEMPLATE,
    )
    if vocab_size is not None:
        if vocab_size < len(fast):
            raise ValueError(f"vocab_size {vocab_size} < trained vocabulary {len(fast)}")
        fast.add_tokens([f"<|filler_{i}|>" for i in range(vocab_size - len(fast))],
                        special_tokens=True)
    fast.save_pretrained(out_dir)
    return len(fast)


def _hf_config(p: ModelPreset, vocab_size: int, special: dict[str, int]):
    common = dict(
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=special["<|begin|>"],
        eos_token_id=special["<|end|>"],
        pad_token_id=special["<|pad|>"],
        dtype="float32",
    )
    if p.arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    if p.arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, use_sliding_window=False)
    raise ValueError(f"unknown architecture {p.arch!r}")


def _init_weights(model, seed: int) -> None:
    """Fill every parameter from one seeded generator, in name order.

    Norms are 1; the output head is wide enough that greedy choices are
    clear-cut (so reference comparisons are not decided by rounding).
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.fill_(1.0)
                continue
            std = 0.02 if name.endswith("bias") else 1.0 / hidden**0.5
            if "lm_head" in name:
                std = 0.2
            elif "embed_tokens" in name:
                std = 1.0
            param.copy_(torch.randn(param.shape, generator=g) * std)


def build_model(out_dir: str, preset: str = "tiny", seed: int = 0) -> None:
    """Write tokenizer and model (weights only when the preset asks for them)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = PRESETS[preset]
    os.makedirs(out_dir, exist_ok=True)
    vocab = build_tokenizer(out_dir, p.vocab_size, p.arch)
    tok = AutoTokenizer.from_pretrained(out_dir)
    special = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = _hf_config(p, vocab, special)
    if not p.write_weights:
        config.save_pretrained(out_dir)
        return
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    model.generation_config.save_pretrained(out_dir)


def module_dims(model_dir: str, targets: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Full module path -> (in, out) for the target modules, read from the
    model's own architecture (built on the meta device). Embeddings count as
    (vocab, dim), the shape PEFT's embedding LoRA uses."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    dims = {}
    for name, mod in model.named_modules():
        if short_name(name) not in targets:
            continue
        if isinstance(mod, torch.nn.Linear):
            dims[name] = (mod.in_features, mod.out_features)
        elif isinstance(mod, torch.nn.Embedding):
            dims[name] = (mod.num_embeddings, mod.embedding_dim)
    return dims


@dataclass(frozen=True)
class AdapterRecord:
    name: str
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: list[str]
    path: str  # relative to the directory of adapters.json


def make_adapter(
    path: str,
    dims: dict[str, tuple[int, int]],
    *,
    rank: int,
    alpha: float,
    seed: int,
    base_model: str,
    use_rslora: bool = False,
    strength: float = 0.5,
) -> None:
    """A random adapter whose delta has about `strength` times the RMS of the
    layer input (A rows are unit-norm in expectation; B sets the size)."""
    import math

    import torch

    g = torch.Generator().manual_seed(seed)
    scaling = alpha / (math.sqrt(rank) if use_rslora else rank)
    weights, embeddings = {}, []
    for module, (n_in, n_out) in sorted(dims.items()):
        embedding = short_name(module) in EMBEDDING_TARGETS
        # An embedding's input is one-hot: unit-variance A rows, not 1/sqrt(vocab).
        a = torch.randn(rank, n_in, generator=g) / (1.0 if embedding else math.sqrt(n_in))
        b = torch.randn(n_out, rank, generator=g) * (strength / (scaling * math.sqrt(rank)))
        weights[module] = (a, b)
        if embedding:
            embeddings.append(module)
    write_adapter(path, weights, rank=rank, alpha=alpha, base_model=base_model,
                  use_rslora=use_rslora, embeddings=embeddings)


def build_adapters(
    model_dir: str,
    out_dir: str,
    num_adapters: int,
    base_model: str,
    ranks: tuple[int, ...] = DEMO_RANKS,
    targets: tuple[str, ...] = ALL_TARGETS,
    seed: int = 1,
) -> list[AdapterRecord]:
    """`num_adapters` adapters, ranks round-robin; alpha cycles through 2r,
    r/2 and 3r/2 so that it never equals the rank."""
    dims = module_dims(model_dir, targets)
    records = []
    for i in range(num_adapters):
        rank = ranks[i % len(ranks)]
        alpha = int(rank * (2.0, 0.5, 1.5)[i % 3])
        name = f"adapter-{i:03d}-r{rank}"
        path = os.path.join(out_dir, name)
        make_adapter(path, dims, rank=rank, alpha=alpha, seed=seed * 100_003 + i,
                     base_model=base_model)
        records.append(AdapterRecord(name, rank, alpha, False, sorted(targets),
                                     os.path.join(os.path.basename(out_dir), name)))
    return records


def build_assets(
    out_dir: str, *, preset: str = "tiny", num_adapters: int = 25, seed: int = 0
) -> list[AdapterRecord]:
    out_dir = os.path.abspath(out_dir)
    model_dir = os.path.join(out_dir, "model")
    build_model(model_dir, preset, seed)
    records = build_adapters(model_dir, os.path.join(out_dir, "adapters"), num_adapters,
                             base_model=f"loraserve-demo/{preset}", seed=seed + 1)
    with open(os.path.join(out_dir, "adapters.json"), "w") as f:
        json.dump([asdict(r) for r in records], f, indent=1)
    return records
