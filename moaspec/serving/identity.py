"""Which drafter a split pair runs: both halves must hold the same weights (the server encodes the
context with its copy, the client drafts with its own), so they compare a fingerprint. The OpenAI
API names the server's drafter the same way (its `system_fingerprint`)."""

from __future__ import annotations

import hashlib

import torch


def drafter_method(drafter: object) -> str:
    """'moa', 'eagle' (from the network) or the class name of a model-free drafter."""
    net = getattr(drafter, "net", None)
    return getattr(net, "method", None) or type(drafter).__name__


MODEL_FREE_FORMS = {"NoDrafter": "none", "NgramDrafter": "ngram"}


def drafter_form(drafter: object) -> str:
    """The drafter as a user names it (`--drafter`): 'none', 'ngram', 'moa', 'eagle', and
    'moa+ngram' / 'eagle+ngram' for a model drafter that tries prompt lookup first."""
    if getattr(drafter, "net", None) is None:
        return MODEL_FREE_FORMS.get(type(drafter).__name__, type(drafter).__name__)
    return drafter_method(drafter) + ("+ngram" if getattr(drafter, "lookup", None) is not None else "")


@torch.inference_mode()
def drafter_fingerprint(drafter: object) -> str:
    """sha256 (first 16 hex digits) over the drafter network's parameters; the method name for
    model-free drafters."""
    net = getattr(drafter, "net", None)
    digest = hashlib.sha256(drafter_method(drafter).encode())
    if net is not None:
        for name, tensor in sorted(net.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
