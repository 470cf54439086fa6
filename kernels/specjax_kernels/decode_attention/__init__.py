"""Attention of a few new tokens over a layer of a stacked KV cache (cached decoding)."""
