"""Tests of the graph rewrites: the matching toolkit, the mask reader, the softmax-attention rewrite
per model family, and the test backend that keeps them cheap (graph_capture.py)."""
