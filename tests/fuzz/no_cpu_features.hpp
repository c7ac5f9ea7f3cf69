// Force-included into the kernels in a BATCHLM_FUZZ build with clang before 16, which knows no
// "f16c" or "avxvnni" for __builtin_cpu_supports, so the SIMD kernels' run-time check would not
// compile: it reports no such CPU instead, and the harnesses run the portable kernels (none of
// them fuzzes a kernel).
#pragma once
#define __builtin_cpu_supports(feature) 0
