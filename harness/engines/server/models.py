"""Tiny random-weight models for running real sglang servers on CPU, built locally (never the hub).

``tiny-llama`` (full attention) and ``tiny-mellum-swa`` (hybrid SWA), each with a tokenizer trained here,
small enough that a server starts in seconds on CPU. Builds are deterministic and atomic. The shapes:
docs/modules.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

#: Repo-ignored default cache of built models (``models/`` at the repository root).
DEFAULT_CACHE_DIR = Path(__file__).resolve().parents[4] / "models"

VOCAB_SIZE = 512
BOS_ID, EOS_ID, PAD_ID = 1, 2, 3
#: First token id that is an ordinary (non-special) token: prompts made of ids use ids from here on.
FIRST_PLAIN_ID = 4


@dataclass(frozen=True)
class TinyModel:
    """The recipe of one tiny model; ``config`` holds the transformers config kwargs."""

    name: str
    architecture: str  # "llama" or "mellum"
    config: dict = field(default_factory=dict)
    seed: int = 0

    @property
    def sliding_window(self) -> int | None:
        return self.config.get("sliding_window")

    def fingerprint(self) -> str:
        """A short hash of the recipe: a changed recipe gets a new directory, never a stale model."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
)

TINY_LLAMA = TinyModel("tiny-llama", "llama", dict(_COMMON, num_hidden_layers=2))
TINY_MELLUM_SWA = TinyModel(
    "tiny-mellum-swa",
    "mellum",
    dict(
        _COMMON,
        num_hidden_layers=4,
        head_dim=16,
        sliding_window=64,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"],
        mlp_layer_types=["dense"] * 4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
)
MODELS = {m.name: m for m in (TINY_LLAMA, TINY_MELLUM_SWA)}

_TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello world, this is a tiny test model for sglang on cpu.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
] * 50


def _build_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],  # ids 0..3, matching BOS/EOS/PAD above
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_TOKENIZER_TEXT, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    fast.save_pretrained(str(path))


def _build_weights(spec: TinyModel, path: Path) -> None:
    import torch

    torch.manual_seed(spec.seed)
    if spec.architecture == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**spec.config))
    elif spec.architecture == "mellum":
        from transformers import AutoModelForCausalLM
        from transformers.models.mellum.configuration_mellum import MellumConfig

        model = AutoModelForCausalLM.from_config(MellumConfig(**spec.config))
    else:
        raise ValueError(f"unknown tiny architecture {spec.architecture!r}; use llama or mellum")
    model.to(torch.bfloat16).save_pretrained(str(path), safe_serialization=True)


def ensure_model(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the directory of tiny model ``name``, building it first if it is not cached.

    Args:
        name: a key of :data:`MODELS` (``tiny-llama`` or ``tiny-mellum-swa``).
        cache_dir: where built models live; default the repo-ignored ``models/``.

    Returns:
        The model directory (config, safetensors weights, tokenizer).

    Raises:
        KeyError: unknown model name.
    """
    if name not in MODELS:
        raise KeyError(f"unknown tiny model {name!r}; use one of {', '.join(MODELS)}")
    spec = MODELS[name]
    root = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    target = root / f"{spec.name}-{spec.fingerprint()}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=root))
    try:
        log.info("building tiny model %s into %s", name, target)
        _build_weights(spec, tmp)
        _build_tokenizer(tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished the same build first; its copy is identical (fixed seed).
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
