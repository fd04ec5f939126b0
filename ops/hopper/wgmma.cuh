/* Warpgroup MMA (wgmma.mma_async, sm_90a) with fp32 accumulators and 16-bit operands (IS_BF16: 1 bfloat16,
   0 float16), both operands in shared memory with the 128-byte swizzle. */
#if IS_BF16
#define WGMMA_M64N64K16 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
#define WGMMA_M64N256K16 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
#else
#define WGMMA_M64N64K16 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
#define WGMMA_M64N256K16 "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
#endif

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
/* Shared-memory matrix descriptor, 128-byte swizzle. K-major operands: lead = unused (16), stride =
   1024 (next 8 rows). N-major operands: lead = next 64-channel panel, stride = next 8 K-rows. */
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 lead, u32 stride) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lead >> 4) << 16) | ((u64)(stride >> 4) << 32) | (1ull << 62);
}

/* The accumulator operands of one MMA (read and written: the "+f" of 32 floats a thread for n = 64, 128 for
   n = 256) and the matching register lists of the instruction. */
#define WGMMA_ACC32(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WGMMA_ACC128(d) WGMMA_ACC32(d), WGMMA_ACC32((d + 32)), WGMMA_ACC32((d + 64)), WGMMA_ACC32((d + 96))
#define WGMMA_D32 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WGMMA_D128 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
  "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, " \
  "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, " \
  "%97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, " \
  "%113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"

/* d [64 x 64] (+)= A [64 x 16] B^T, B K-major (the score product S = Q K^T). */
__device__ __forceinline__ void wgmma_scores(float* d, u64 desc_a, u64 desc_b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" WGMMA_M64N64K16 WGMMA_D32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
               : WGMMA_ACC32(d) : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}
/* d [64 x 256] (+)= A [64 x 16] B [16 x 256], B N-major (the value product O += P V). */
__device__ __forceinline__ void wgmma_values(float* d, u64 desc_a, u64 desc_b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" WGMMA_M64N256K16 WGMMA_D128
               ", %128, %129, p, 1, 1, 0, 1;\n}\n" : WGMMA_ACC128(d) : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}
