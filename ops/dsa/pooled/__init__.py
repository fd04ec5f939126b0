"""glm5_next's pooled DSA indexer: the blockwise torch reference (the CPU path), the pool keys formed in Triton or
by the CUDA kernel over whole token rows, the Triton pool scores and top-k, and the rows in Hugging Face's slot
layout."""
