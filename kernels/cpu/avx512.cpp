// The AVX2 kernels a third time, compiled for AVX-512VL with VNNI: the same 256-bit vectors and
// the same sums (the results equal the AVX2 path's bit for bit), but the 32 vector registers of
// the EVEX encoding let each matrix tile serve 4 tokens, and the packed tiles take two groups
// of 8 rows at once in 512-bit vectors (AVX-512BW). Chosen at run time when the CPU has it.
#define BATCHLM_KERNELS_AVX512 1
#include "avx2.cpp"
