// The AVX2 kernels again, with the 8-bit dot products on AVX-VNNI (vpdpbusd): the same sums,
// one instruction instead of two. Compiled with -mavxvnni; chosen at run time when the CPU has it.
#define BATCHLM_KERNELS_VNNI 1
#include "avx2.cpp"
