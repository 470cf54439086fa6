from specjax_kernels.soft_ce.api import soft_cross_entropy  # noqa: F401
