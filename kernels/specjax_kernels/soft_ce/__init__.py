from specjax_kernels.soft_ce.api import fused_linear_soft_ce, soft_cross_entropy  # noqa: F401
