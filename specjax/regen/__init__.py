"""Parts of the regeneration stage (`python -m specjax.regenerate`): input reading, the JAX and the
OpenAI-compatible back ends, the sharded parquet output with its manifest."""
from specjax.regen.common import Answer, Item, ManifestMismatch, RegenerateError, Redactor, prompt_messages

__all__ = ["Answer", "Item", "ManifestMismatch", "RegenerateError", "Redactor", "prompt_messages"]
