"""The DSA sparse-attention stage: each query attends to its own gathered top-k keys. Forward in Triton and as the
sm_90a warpgroup-MMA kernel, backward in Triton."""
