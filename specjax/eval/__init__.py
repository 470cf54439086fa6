"""Generation and lossless speculative decoding with the JAX target (`generate`, `spec_decode`) and the
evaluation CLI (`python -m specjax.eval`). Kept import-free so the CLI's --help stays cheap."""
