"""What a traced program holds: the kernel tests' memory checks read every intermediate's shape and
dtype from its jaxpr."""


def jaxpr_avals(jaxpr):
    """The abstract value (shape, dtype) of every equation output in `jaxpr`, sub-jaxprs (scan, cond,
    custom_vjp, pjit bodies) included."""
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield v.aval
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else [p]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from jaxpr_avals(inner)
