"""CUDA device helpers shared by the sm_90a NVRTC kernels of several ops (no Python API).

``ptx.cuh``: integer / float helpers and PTX wrappers for ``cp.async``, named barriers, mbarriers and TMA copies;
``wgmma.cuh``: warpgroup MMA (``wgmma.mma_async``) with both operands in shared memory and its descriptors;
``latent_tile.cuh``: the 128-byte-swizzled [64 x 576] latent tile and the online-softmax step over a wgmma score
tile, shared by the MLA decode and DSA sparse-attention kernels. A kernel in an op's stage folder includes them as
``#include "../../hopper/<file>.cuh"`` (``kda_compile.ops._nvrtc.cuda_source`` resolves ``../`` to the parent
package and inlines each file once)."""
