from specjax_kernels.moe.api import ACTIVATIONS, moe_experts  # noqa: F401
