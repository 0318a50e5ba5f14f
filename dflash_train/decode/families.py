"""One line per target saying what runs on its family and why not: printed when a run starts.

The verdicts are the behaviour probes the code paths themselves use (feature forward, static
decoder, batched generator, hybrid rollback), asked here once, so the line says what will run.
"""

from __future__ import annotations

from collections import Counter

from ..target.model import Target, family_kind, has_recurrent_layers, text_config
from ..target.probe import feature_forward_unsupported, static_unsupported
from ..target.static_cache import cache_capacity
from .hf import rollback_unsupported


def describe_target(target: Target, tokens: int) -> str:
    """`target: <type> (<kind>[, layer kinds]): capture ...; decode ...; regenerate ...` for rows
    and caches of `tokens` positions."""
    config = target.model.config
    kinds = Counter(getattr(config, "layer_types", None) or ())
    layers = f", {' + '.join(f'{n} {kind}' for kind, n in kinds.items())}" if len(kinds) > 1 else ""
    capture_refusal = feature_forward_unsupported(target, tokens)
    capture = ("capture: the graph-capturable feature forward" if capture_refusal is None
               else f"capture: the Hugging Face forward stopped at the last needed layer ({capture_refusal})")
    static_refusal = static_unsupported(target, cache_capacity(tokens))
    recurrent = has_recurrent_layers(config)
    if static_refusal is None:
        decode = "decode: static decoder"
        regenerate = "regenerate: static batched generator"
        if recurrent:
            decode += ", linear-attention states advanced by the kept tokens of each verify step"
            regenerate += " (linear-attention states per slot)"
    else:
        decode = f"decode: Hugging Face, eager (static: {static_refusal})"
        regenerate = "regenerate: Hugging Face eager batches"
        if recurrent:
            rollback = rollback_unsupported(target)
            decode += (", recurrent states rolled back after a rejection" if rollback is None
                       else f", speculative decoding refused: {rollback}")
    return f"target: {text_config(config).model_type} ({family_kind(config)}{layers}): {capture}; {decode}; {regenerate}"
