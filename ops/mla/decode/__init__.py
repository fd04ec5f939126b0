"""The absorbed MLA decode kernels: the Triton split-KV kernel and its merge, the sm_90a warpgroup-MMA kernel, and
the choice between them per call (``kernels.py``)."""
