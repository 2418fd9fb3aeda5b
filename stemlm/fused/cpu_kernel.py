"""The row AdamW of the fused path on the CPU as one C++ loop (built by inductor's C++ toolchain).

``torch.compile`` of ``kernels.indexed_update_`` needs two passes: it cannot prove that the
gathered rows of a moment and the rows written back are the same ones, so it stores the new
moments in temporaries first (11 row-sized reads and writes per updated row instead of 7). Here
one loop per row reads the gradient, the row and its moments once and writes them once, rows in
parallel (OpenMP), columns in SIMD vectors. The moments are computed with the fused multiply-adds
ATen's ``lerp_``/``addcmul_`` use (bit-identical to the eager path); the row itself may differ in
its last bit (the compiler's floating-point flags are inductor's). Built once per process on first use (a few seconds;
cached on disk by inductor); ``load()`` returns None where it cannot be built, and the compiled
torch function is used instead. Tested equal to the eager reference in tests/test_fused_tables.py.
"""

from __future__ import annotations

import torch

SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C" void kernel(float* weight, float* exp_avg, float* exp_avg_sq, const int64_t* flat, const float* w_rows,
                       const float* grad, const float* decay, const float* neg_step, const float* eps_r,
                       const float* betas, const int64_t K, const int64_t D)
{
    using Vec = at::vec::Vectorized<float>;
    const float b1w = betas[0], b2 = betas[1], b2w = betas[2];  // 1 - beta1, beta2, 1 - beta2
    #pragma omp parallel for
    for (int64_t r = 0; r < K; ++r) {
        const int64_t row = flat[r];
        float* w = weight + row * D;
        float* m = exp_avg + row * D;
        float* v = exp_avg_sq + row * D;
        const float* wr = w_rows + r * D;
        const float* g = grad + r * D;
        const float dec = decay[r], neg = neg_step[r], eps = eps_r[r];
        const Vec vb1w(b1w), vb2(b2), vb2w(b2w), vdec(dec), vneg(neg), veps(eps);
        int64_t j = 0;
        for (; j + Vec::size() <= D; j += Vec::size()) {
            const Vec gv = Vec::loadu(g + j);
            const Vec m0 = Vec::loadu(m + j);
            const Vec mv = at::vec::fmadd(vb1w, gv - m0, m0);  // lerp(m, g, 1 - beta1), as ATen computes it
            const Vec vv = at::vec::fmadd(vb2w * gv, gv, Vec::loadu(v + j) * vb2);  // addcmul(v b2, g, g, 1 - b2)
            const Vec wv = Vec::loadu(wr + j) * vdec + (mv * vneg) / (vv.sqrt() + veps);
            mv.store(m + j);
            vv.store(v + j);
            wv.store(w + j);
        }
        for (; j < D; ++j) {
            const float gs = g[j];
            const float ms = std::fma(b1w, gs - m[j], m[j]);
            const float vs = std::fma(b2w * gs, gs, v[j] * b2);
            w[j] = wr[j] * dec + (ms * neg) / (std::sqrt(vs) + eps);
            m[j] = ms;
            v[j] = vs;
        }
    }
}
"""
ARGTYPES = ["float*", "float*", "float*", "const int64_t*", "const float*", "const float*", "const float*",
            "const float*", "const float*", "const float*", "const int64_t", "const int64_t"]
_kernel: list = []  # [callable or None] once tried


def load():
    """The built kernel, or None where it cannot be built (no compiler, another platform)."""
    if not _kernel:
        try:
            from torch._inductor.codecache import CppPythonBindingsCodeCache
            _kernel.append(CppPythonBindingsCodeCache.load_pybinding(ARGTYPES, SOURCE))
        except Exception:  # the compiled torch function computes the same update
            _kernel.append(None)
    return _kernel[0]


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the C++ loop can take these operands: contiguous fp32/int64 CPU tensors."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def indexed_update_cpu_(weight, exp_avg, exp_avg_sq, flat, w_rows, g, decay, neg_step, eps_r, b1: float, b2: float) -> None:
    """``kernels.indexed_update_`` (every row valid) as one C++ loop; the caller checked ``applies``."""
    betas = torch.tensor([1 - b1, b2, 1 - b2], dtype=torch.float32)
    load()(weight, exp_avg, exp_avg_sq, flat, w_rows, g, decay, neg_step, eps_r, betas, flat.numel(), weight.shape[1])
