"""Mixture-of-experts expert computation (``moe_experts``): gated SiLU experts over routed tokens."""
from kda_compile.ops.moe.api import moe_experts

__all__ = ["moe_experts"]
