from specjax_kernels.gated_delta.api import gated_delta_rule  # noqa: F401
