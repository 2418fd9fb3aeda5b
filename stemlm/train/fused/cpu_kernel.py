"""The row AdamW of the fused path on the CPU as one C++ loop (built by inductor's C++ toolchain).

``torch.compile`` of ``kernels.indexed_update_`` needs two passes: it cannot prove that the
gathered rows of a moment and the rows written back are the same ones, so it stores the new
moments in temporaries first (11 row-sized reads and writes per updated row instead of 7). Here
one loop per row computes the row's factors (bias corrections, decay: ``row_factors``'s formulas in
double precision), reads the gradient, the row and its moments once, writes them and the row's
counters once; rows in parallel (OpenMP), columns in SIMD vectors. The moments use the fused
multiply-adds of ATen's ``lerp_``/``addcmul_`` (bit-identical to the eager path); the row may
differ in its last bit. Built once per process on first use (a few seconds; cached on disk by
inductor); ``load()`` returns None where it cannot be built, and the torch path is used instead.
"""

from __future__ import annotations

import torch

SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <cmath>
extern "C" void kernel(float* weight, float* exp_avg, float* exp_avg_sq, int64_t* step, int64_t* last,
                       const int64_t* flat, const float* w_rows, const float* grad, const double* s,
                       const int64_t K, const int64_t D)
{
    using Vec = at::vec::Vectorized<float>;
    // s: lr, weight_decay, global_step, beta1, beta2, eps, catchup
    const double lr = s[0], wd = s[1], gs = s[2], b1 = s[3], b2 = s[4], eps = s[5];
    const bool catchup = s[6] != 0.0;
    const float b1w = (float)(1.0 - b1), b2f = (float)b2, b2w = (float)(1.0 - b2);
    #pragma omp parallel for
    for (int64_t r = 0; r < K; ++r) {
        const int64_t row = flat[r];
        const int64_t n = step[row] + 1;
        double decay = 1.0;
        if (wd != 0.0) {
            decay = 1.0 - lr * wd;
            if (catchup) decay = std::pow(decay, gs - (double)last[row]);
        }
        const double bc2_sqrt = std::sqrt(1.0 - std::pow(b2, (double)n));
        const float dec = (float)decay, neg = (float)(-lr * bc2_sqrt / (1.0 - std::pow(b1, (double)n)));
        const float eps_r = (float)(eps * bc2_sqrt);
        step[row] = n;
        last[row] = (int64_t)gs;
        float* w = weight + row * D;
        float* m = exp_avg + row * D;
        float* v = exp_avg_sq + row * D;
        const float* wr = w_rows + r * D;
        const float* g = grad + r * D;
        const Vec vb1w(b1w), vb2(b2f), vb2w(b2w), vdec(dec), vneg(neg), veps(eps_r);
        int64_t j = 0;
        for (; j + Vec::size() <= D; j += Vec::size()) {
            const Vec gv = Vec::loadu(g + j);
            const Vec m0 = Vec::loadu(m + j);
            const Vec mv = at::vec::fmadd(vb1w, gv - m0, m0);                    // lerp(m, g, 1 - beta1)
            const Vec vv = at::vec::fmadd(vb2w * gv, gv, Vec::loadu(v + j) * vb2);  // addcmul(v b2, g, g, 1 - b2)
            const Vec wv = Vec::loadu(wr + j) * vdec + (mv * vneg) / (vv.sqrt() + veps);
            mv.store(m + j);
            vv.store(v + j);
            wv.store(w + j);
        }
        for (; j < D; ++j) {
            const float gs_ = g[j];
            const float ms = std::fma(b1w, gs_ - m[j], m[j]);
            const float vs = std::fma(b2w * gs_, gs_, v[j] * b2f);
            w[j] = wr[j] * dec + (ms * neg) / (std::sqrt(vs) + eps_r);
            m[j] = ms;
            v[j] = vs;
        }
    }
}
"""
ARGTYPES = ["float*", "float*", "float*", "int64_t*", "int64_t*", "const int64_t*", "const float*", "const float*",
            "const double*", "const int64_t", "const int64_t"]
_kernel: list = []  # [callable or None] once tried


def load():
    """The built kernel, or None where it cannot be built (no compiler, another platform)."""
    if not _kernel:
        try:
            from torch._inductor.codecache import CppPythonBindingsCodeCache
            _kernel.append(CppPythonBindingsCodeCache.load_pybinding(ARGTYPES, SOURCE))
        except Exception:  # the torch path computes the same update
            _kernel.append(None)
    return _kernel[0]


def row_adamw_(weight, exp_avg, exp_avg_sq, step, last, flat, w_rows, grad, *, lr: float, weight_decay: float,
               global_step: int, betas: tuple[float, float], eps: float, catchup: bool) -> bool:
    """AdamW on rows ``flat (K,)`` of ``weight``/``exp_avg``/``exp_avg_sq`` ``(R, D)`` and their
    counters ``step``/``last`` ``(R,)`` from ``w_rows``/``grad`` ``(K, D)``, in one C++ loop (the
    rows must be distinct; ``w_rows`` may be ``weight`` itself when ``flat`` is ``arange(R)``).
    False (nothing done) where the loop cannot run: not all contiguous CPU tensors, or not built."""
    operands = (weight, exp_avg, exp_avg_sq, step, last, flat, w_rows, grad)
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in operands) or load() is None:
        return False
    scalars = torch.tensor([lr, weight_decay, global_step, betas[0], betas[1], eps, float(catchup)], dtype=torch.float64)
    load()(*operands, scalars, flat.numel(), weight.shape[1])
    return True
