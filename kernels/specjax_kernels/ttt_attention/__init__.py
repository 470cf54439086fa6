from specjax_kernels.ttt_attention.api import ttt_attention  # noqa: F401
