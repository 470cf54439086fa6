from specjax_kernels.ssd.api import ssd  # noqa: F401
