"""A transformers model on headwise, verified: ``load`` (load and check) and ``check`` (a loaded model)."""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType

from torch import nn

from .._optional import require
from .adapter import attend, register
from .routing import computes_attention_itself, masks_through_interface, refuse_never_routed


def _allowed(allow: object) -> None:
    """``allow`` must be an iterable of class names, not one name (a str's letters would be names)."""
    if isinstance(allow, str) or not isinstance(allow, Iterable) or not all(isinstance(name, str) for name in allow):
        raise TypeError(f"allow must be an iterable of class names (str), got {allow!r}")


def check(model: nn.Module, *, allow: Iterable[str] = ()) -> nn.Module:
    """Raise unless every attention layer of ``model`` runs on headwise; return ``model``.

    A model loaded with ``attn_implementation="headwise"`` can still bypass headwise in two ways,
    both refused here with a TypeError naming what bypasses it:

    - a part of it runs on another implementation (``sdpa``, ``eager``: a sub-model given its
      own, or a model class that does not let ``set_attn_implementation`` change it);
    - some of its attention layers compute attention themselves instead of calling
      transformers' ``AttentionInterface`` (see ``headwise.hf.routing``), e.g. Bloom's, or CLAP's
      audio tower beside its text tower that does call it. Those among them that read
      transformers' mask get the one headwise builds (booleans, where eager's are additive
      floats) and compute something else than eager (BigBird-Pegasus' encoder).

    Args:
        model: a transformers ``PreTrainedModel``, or a module holding one.
        allow: names of attention classes accepted outside headwise, for a model whose other
            layers run on it (Gemma 4's audio tower: ``allow={"Gemma4AudioAttention"}``) once
            their results have been compared with eager's.

    Returns:
        ``model``, so that ``model = check(from_pretrained(...))`` reads as one step.

    Example:
        >>> import torch, transformers
        >>> config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                                   num_attention_heads=4, vocab_size=100)
        >>> model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=register())
        >>> check(model) is model
        True
    """
    transformers = require("transformers", "hf", "checking a transformers model")
    _allowed(allow)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a transformers PreTrainedModel (an nn.Module), got {type(model).__name__}")
    parts = [m for m in model.modules() if isinstance(m, transformers.PreTrainedModel)]
    if not parts:
        raise TypeError(f"model must be a transformers PreTrainedModel or hold one, got {type(model).__name__} holding none")
    interface = transformers.AttentionInterface()
    elsewhere = {}
    for part in parts:
        implementation = getattr(part.config, "_attn_implementation", None)
        if implementation not in interface or interface[implementation] is not attend:
            elsewhere.setdefault(implementation, type(part).__name__)
    if elsewhere:
        where = ", ".join(f"{part} runs attention on {implementation!r}" for implementation, part in elsewhere.items())
        raise TypeError(
            f"{type(model).__name__} does not run on headwise: {where}; load it with "
            "attn_implementation=headwise.hf.register(), or call model.set_attn_implementation(...) with that name"
        )
    for part in parts:  # masks built by headwise.hf.mask for layers none of which calls attend: the first forward would raise
        if masks_through_interface(type(part.config)):  # (so no allow= runs it)
            refuse_never_routed(part.config)
    own = sorted({type(m).__name__ for m in model.modules() if computes_attention_itself(type(m))} - set(allow))
    if own:
        raise TypeError(
            f"{type(model).__name__} does not run every attention layer on headwise: its layers of class {', '.join(own)} "
            "compute attention themselves instead of calling transformers' AttentionInterface, so headwise is never called there "
            f"(allow={set(own)!r} accepts them)"
        )
    return model


def load(model_class: type, source: object, *, allow: Iterable[str] = (), strict: bool = True, **kwargs) -> nn.Module:
    """``model_class.from_pretrained(source, **kwargs)`` on headwise (``from_config`` when ``source``
    is a config), then ``check``: registers ``"headwise"``, and says by name what cannot run on it.

    Args:
        model_class: a transformers model class (``AutoModelForCausalLM``, ``LlamaForCausalLM``, ...).
        source: what ``from_pretrained`` takes (a directory, a hub name), or a ``PretrainedConfig``.
        allow: attention classes accepted outside headwise (see ``check``).
        strict: refuse a checkpoint that leaves any of the model's weights unloaded (missing, or of
            another shape), which ``from_pretrained`` would initialise at random and report in a log
            line only. ``strict=False`` takes them as transformers does (a new task head to train).
            Tensors the model has no place for (a causal LM's head under ``AutoModel``) are ignored,
            as transformers ignores them.
        **kwargs: passed on (``dtype``, ``device_map``, ...); ``attn_implementation`` is this function's.

    Returns:
        The model, every attention layer on headwise.

    Raises:
        TypeError: the model cannot run on headwise (see ``check``), including architectures that
            pick their attention class from a table of their own (GPT-Neo, Bark, GIT), which
            transformers reports as a bare ``KeyError: 'headwise'``.
        ValueError: ``strict`` and a checkpoint that does not fill every weight, each one named.

    Example:
        >>> import transformers
        >>> config = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                                  num_attention_heads=4, vocab_size=100)
        >>> type(load(transformers.AutoModel, config)).__name__
        'BertModel'
    """
    transformers = require("transformers", "hf", "loading a transformers model on headwise")
    if "attn_implementation" in kwargs:
        raise TypeError(f"load sets attn_implementation itself (to headwise), got attn_implementation={kwargs['attn_implementation']!r}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True or False, got {type(strict).__name__} {strict!r}")
    if not (isinstance(model_class, type) and any(hasattr(model_class, m) for m in ("from_pretrained", "from_config", "_from_config"))):
        raise TypeError(f"model_class must be a transformers model class (AutoModelForCausalLM, LlamaForCausalLM, ...), "
                        f"got {model_class!r}")
    _allowed(allow)  # (before the model is built)
    name = register()
    configured = isinstance(source, transformers.PretrainedConfig)
    if configured:
        build = getattr(model_class, "from_config", None) or model_class._from_config
    else:
        build = model_class.from_pretrained
        wanted = kwargs.pop("output_loading_info", False)  # (read here either way)
        kwargs["output_loading_info"] = True
        if strict:  # a weight of another shape reported, then named below (transformers raises a RuntimeError naming none)
            kwargs.setdefault("ignore_mismatched_sizes", True)
    try:
        model = build(source, attn_implementation=name, **kwargs)
    except KeyError as e:
        if e.args != (name,):
            raise
        raise TypeError(_own_table(e.__traceback__, name)) from None
    if configured:
        return check(model, allow=allow)
    model, info = model
    if strict:
        _loaded_whole(model, source, info)
    check(model, allow=allow)
    return (model, info) if wanted else model


def _loaded_whole(model: nn.Module, source: object, info: dict) -> None:
    """Raise a ValueError naming every weight ``from_pretrained`` left at its random start (``info``: its loading info)."""
    missing = sorted(info.get("missing_keys", ()))
    mismatched = sorted(info.get("mismatched_keys", ()), key=lambda m: m[0])
    if not missing and not mismatched:
        return
    lines = [f"{type(model).__name__}.from_pretrained({source!r}) left weights at their random start (strict=True):"]
    lines += [f"  missing: {key}" for key in missing]
    lines += [f"  wrong shape: {key}: checkpoint {tuple(theirs)}, model {tuple(ours)}" for key, theirs, ours in mismatched]
    lines.append("pass strict=False to take them as transformers does (a new task head to train; a weight of another shape "
                 "with ignore_mismatched_sizes=True too)")
    raise ValueError("\n".join(lines))


def _own_table(tb: TracebackType | None, name: str) -> str:
    """The message for a model whose layer looked ``name`` up in its own table of attention classes."""
    where = "its layers pick"
    while tb is not None:  # the innermost frame that has a ``self`` did the lookup
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module):
            where = f"{type(owner).__name__} ({type(owner).__module__}) picks"
        tb = tb.tb_next
    return (
        f"attn_implementation={name!r}: {where} its attention class from a table of its own, keyed by "
        "attn_implementation, instead of calling transformers' AttentionInterface; the table has no entry for "
        f"{name!r}, so this architecture cannot run on headwise: load it with attn_implementation='eager' or 'sdpa'"
    )
