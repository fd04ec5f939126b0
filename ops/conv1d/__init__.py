"""The causal depthwise conv1d of a decode step with its rolling state (``causal_conv1d_update``): what the
linear-attention layers of Hugging Face's hybrid models run on q / k / v before the delta rule."""
from kda_compile.ops.conv1d.api import causal_conv1d_update

__all__ = ["causal_conv1d_update"]
