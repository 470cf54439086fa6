"""What the target parity tests (specjax.targets vs transformers) share: the error metric and the
redraw of a transformers model's weights to scales far from its init.

Import as `parity._hf_weights` (tests/ is on sys.path through its conftest)."""
import numpy as np


def rel_err(ours, ref) -> float:
    """max|ours - ref| / max|ref|, in float64."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def randomize_(model, seed: int, embed_names=("embed_tokens",)) -> None:
    """Redraw the weights of a transformers model in place (torch Generator seeded `seed`, in
    named_parameters order): norm weights 1 + 0.2 * N(0, 1), parameters whose name holds one of
    `embed_names` std 0.5, every other one std 0.15."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif any(e in name for e in embed_names):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def hf_run(model, ids, positions=None):
    """A transformers causal LM on token ids [B, T] (CPU, no grad, no cache): (logits, [output of
    each decoder layer], final hidden after the final norm), as numpy; read with forward hooks on
    ``model.model.layers`` and ``model.model.norm``."""
    import torch

    calls, final = [], []
    hooks = [m.register_forward_hook(lambda mod, a, o: calls.append(o[0] if isinstance(o, tuple) else o))
             for m in model.model.layers]
    hooks.append(model.model.norm.register_forward_hook(lambda mod, a, o: final.append(o)))
    kw = {} if positions is None else {"position_ids": torch.tensor(positions, dtype=torch.long)}
    try:
        with torch.no_grad():
            out = model(torch.tensor(ids, dtype=torch.long), use_cache=False, **kw)
    finally:
        for h in hooks:
            h.remove()
    return out.logits.numpy(), [c.numpy() for c in calls], final[0].numpy()


def assert_matches_hf(target, model, ids, positions, aux_ids, tol: float, label: str = "") -> dict:
    """The target's logits, final hidden and aux states at ``aux_ids`` against transformers' (hf_run)
    on the same ids and positions: each within ``tol`` (rel_err), and the logits O(1) so the bound
    is not vacuous. Returns the errors (printed with ``label``)."""
    out = target(ids, aux_layer_ids=aux_ids, positions=positions)
    logits, calls, final = hf_run(model, ids, positions)
    errs = {"logits": rel_err(out.logits, logits), "final": rel_err(out.final_hidden, final)}
    errs.update({f"aux{a}": rel_err(h, calls[a]) for a, h in zip(aux_ids, out.aux_hidden)})
    print(f"{label}: " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()))
    assert max(errs.values()) <= tol, errs
    assert np.abs(logits).max() > 1.0  # O(1) logits: the comparison is not trivial
    return errs
