"""Text in, text out, offline: a byte-level BPE and a tiny GPT-2 learn the Zen of Python, then continue a line.

    python examples/generate_text.py                  # trains both in seconds on a CPU, then generates
    python examples/generate_text.py --model DIR      # a HuggingFace GPT-2 or Llama directory with tokenizer.json

Everything comes with Python and headwise[models] (the ``tokenizers`` package): the text is the
Zen of Python (the ``this`` module), the tokenizer a byte-level BPE trained on it, the model a
``GPT2LMHeadModel`` small enough to learn the text by heart in a few hundred steps.
``headwise.models.generate_text`` puts the tokenizer around ``model.generate``.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from headwise import GPT2Config
from headwise._optional import require
from headwise.models import GPT2LMHeadModel, generate_text, load

END = "<|endoftext|>"
PROMPTS = ["Beautiful is better than", "Errors should never", "Now is better"]


def zen() -> str:
    """The Zen of Python, as ``import this`` prints it (read without printing it)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


def train_tokenizer(text: str, vocab_size: int = 400):
    """A byte-level BPE (GPT-2's kind of tokenizer) trained on ``text``: every string encodes, none is unknown."""
    tokenizers = require("tokenizers", "models", "the text generation example")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[END], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator([text], trainer)
    return tokenizer


def train_model(tokenizer, text: str, *, steps: int = 300, seed: int = 0) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 trained on windows of ``text`` (next-token cross-entropy, AdamW) until it knows it by heart."""
    torch.manual_seed(seed)
    ids = torch.tensor(tokenizer.encode(END + text).ids)  # (N,)
    config = GPT2Config(vocab_size=tokenizer.get_vocab_size(), n_positions=128, n_embd=64, n_layer=2, n_head=4,
                        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    window, batch = 64, 16
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - window - 1, (batch,))
        x = torch.stack([ids[s : s + window] for s in starts])  # (B, T)
        y = torch.stack([ids[s + 1 : s + window + 1] for s in starts])  # (B, T): the next tokens
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())  # logits (B, T, vocab) -> (B*T, vocab)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a HuggingFace directory (config.json, weights, tokenizer.json) instead of training")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:  # before the training, not after it
        parser.error(f"--max-new-tokens must be a positive int, got {args.max_new_tokens}")
    if args.model is None:
        start = time.perf_counter()
        text = zen()
        tokenizer = train_tokenizer(text)
        model = train_model(tokenizer, text)
        print(f"trained a {tokenizer.get_vocab_size()}-token byte-level BPE and a 2-layer GPT-2 on the Zen of Python "
              f"({len(tokenizer.encode(text).ids)} tokens) in {time.perf_counter() - start:.0f} s")
    else:
        tokenizers = require("tokenizers", "models", "the text generation example")
        if not (args.model / "tokenizer.json").is_file():
            parser.error(f"--model must be a HuggingFace directory with config.json, weights and tokenizer.json, got {args.model}")
        try:
            model = load(args.model).eval()
        except (FileNotFoundError, ValueError) as e:
            parser.error(f"--model {args.model}: {e}")
        tokenizer = tokenizers.Tokenizer.from_file(str(args.model / "tokenizer.json"))
    for prompt, continuation in zip(PROMPTS, generate_text(model, tokenizer, PROMPTS, max_new_tokens=args.max_new_tokens), strict=True):
        print(f"\n{prompt!r} ->\n{prompt}{continuation}")


if __name__ == "__main__":
    main()
