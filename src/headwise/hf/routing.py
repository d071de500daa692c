"""Which attention layers of a transformers model reach headwise, read from their classes' source.

A layer runs on ``attn_implementation="headwise"`` only if it hands its queries, keys and values
to transformers' ``AttentionInterface`` (``ALL_ATTENTION_FUNCTIONS.get_interface(...)``). Some
classes compute their attention weights themselves instead: Bloom, GPT-Neo, MPT, XGLM, DeBERTa,
Longformer, BigBird's block-sparse layers, CLAP's audio tower, ``nn.MultiheadAttention``, among
others. transformers asks the same question of a whole model file
(``PreTrainedModel._can_set_attn_implementation``); here each class is read, with its bases.

An attention class is one whose name says ``Attention`` or ``Attn``; it computes attention
itself when its source calls a softmax, ``scaled_dot_product_attention`` or flash-attention and
never the interface. A class whose source cannot be read is not judged.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys

from torch import nn

#: The name of a class that may compute attention.
ATTENTION_NAME = re.compile(r"Attention|Attn")
#: In a class's source: it hands attention to transformers' AttentionInterface.
ROUTES = re.compile(r"ALL_ATTENTION_FUNCTIONS|attention_interface")
#: In a model file's source: it builds its masks through transformers' mask interface (``headwise.hf.mask``).
MASKS = re.compile(r"create_causal_mask|create_sliding_window_causal_mask|create_bidirectional_mask|create_masks_for_generate|"
                   r"ALL_MASK_ATTENTION_FUNCTIONS")
#: In a class's source: it computes attention weights itself.
COMPUTES = re.compile(r"[sS]oftmax\w*\(|logsumexp\(|scaled_dot_product_attention\(|flash_attn")


@functools.cache
def _source(cls: type) -> str | None:
    """The source of ``cls`` and of its bases up to torch's, or None where some cannot be read."""
    parts = []
    for base in cls.__mro__:
        if base is object or base.__module__.split(".")[0] == "torch":
            continue
        try:
            parts.append(inspect.getsource(base))
        except (OSError, TypeError):
            return None
    return "\n".join(parts)


def routes(cls: type) -> bool:
    """True for an attention class that calls transformers' ``AttentionInterface``."""
    source = _source(cls) if ATTENTION_NAME.search(cls.__name__) else None
    return source is not None and ROUTES.search(source) is not None


def computes_attention_itself(cls: type) -> bool:
    """True for an attention class that computes attention without ``AttentionInterface``
    (``nn.MultiheadAttention`` included): headwise never runs there."""
    if issubclass(cls, nn.MultiheadAttention):
        return True
    source = _source(cls) if ATTENTION_NAME.search(cls.__name__) else None
    return source is not None and COMPUTES.search(source) is not None and ROUTES.search(source) is None


@functools.cache
def never_routed(config_class: type) -> tuple[str, ...]:
    """The attention classes of the model file beside ``config_class`` when none of that file's
    attention classes (those it imports included) calls the interface: an architecture headwise
    never runs. () when one does, or when the file is not loaded.

    Example:
        >>> import transformers
        >>> import transformers.models.bloom.modeling_bloom
        >>> never_routed(transformers.BloomConfig)
        ('BloomAttention',)
    """
    module = sys.modules.get(config_class.__module__.replace(".configuration_", ".modeling_"))
    if module is None:
        return ()
    classes = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, nn.Module)]
    if any(routes(c) for c in classes):
        return ()
    return tuple(sorted(c.__name__ for c in classes if computes_attention_itself(c)))


@functools.cache
def masks_through_interface(config_class: type) -> bool:
    """Whether the model file beside ``config_class`` builds its masks through transformers' mask interface, so that
    ``headwise.hf.mask`` builds them (and refuses an architecture that ``never_routed`` names, at its first forward).
    False when the file is not loaded or cannot be read."""
    module = sys.modules.get(config_class.__module__.replace(".configuration_", ".modeling_"))
    try:
        return module is not None and MASKS.search(inspect.getsource(module)) is not None
    except (OSError, TypeError):
        return False


def refuse_never_routed(config: object) -> None:
    """Raise TypeError when ``config``'s architecture computes all its attention itself (see
    ``never_routed``): the masks headwise builds would reach layers that never call it."""
    classes = never_routed(type(config))
    if classes:
        name = getattr(config, "_attn_implementation", None)
        raise TypeError(
            f"attn_implementation={name!r} cannot run {getattr(config, 'model_type', type(config).__name__)!r} models: "
            f"their attention layers ({', '.join(classes)}) compute attention themselves instead of calling "
            "transformers' AttentionInterface, so headwise would never be called (and the masks it builds are not "
            "the ones those layers read); load the model with attn_implementation='eager' or 'sdpa'"
        )
