"""specjax_kernels: accelerator kernels behind one `implementation=` API per op.

Each op has `reference.py` (plain jnp; the definition every other backend is tested against) and
an `api.py` that picks an implementation. Knows nothing of specjax."""
