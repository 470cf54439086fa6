"""Layer math shared by the frozen targets and the draft heads (RMSNorm, RoPE): it belongs to neither,
so a draft never imports target code."""
