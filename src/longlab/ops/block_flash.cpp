// Block-sparse causal flash attention on CPU (forward, float32), for longlab.sparse.block_flash.
//
// One work unit is (b, h, q-block i): bq query rows against the k-blocks listed for it in a CSR list
// (ascending). The unit's rows stay together for the whole pass (one 128-row tile, where aten's fused
// kernel tiles a 128-row call by 32 rows), keys are read in place (k-block j is rows j*bk..j*bk+bk-1 of
// K, contiguous: no gather), runs of adjacent blocks go to one GEMM, and the causal / padding element
// mask of the blocks crossing the diagonal is applied inside the same online softmax (no second pass,
// no log-sum-exp merge):
//   S = scale * Q K_t^T;  m' = max(m, rowmax S);  P = exp(S - m');  l = l e^{m - m'} + rowsum P;
//   O = O e^{m - m'} + P V_t;  at the end O / l.
// GEMMs are the BLAS sgemm that torch links (column-major Fortran interface).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace {

using Vec = at::vec::Vectorized<float>;

// row-major S[M x N] (ld ldc) = alpha * A[M x K] (ld lda) * B[N x K]^T (ld ldb) + beta * S
inline void gemm_abt(int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                     float beta, float* C, int ldc) {
  sgemm_("T", "N", &N, &M, &K, &alpha, B, &ldb, A, &lda, &beta, C, &ldc);
}

// row-major C[M x N] (ld ldc) = A[M x K] (ld lda) * B[K x N] (ld ldb) + beta * C
inline void gemm_ab(int M, int N, int K, const float* A, int lda, const float* B, int ldb, float beta,
                    float* C, int ldc) {
  const float one = 1.0f;
  sgemm_("N", "N", &N, &M, &K, &one, B, &ldb, A, &lda, &beta, C, &ldc);
}

inline float row_max(const float* x, int n) {
  int c = 0;
  Vec vm(-std::numeric_limits<float>::infinity());
  for (; c + Vec::size() <= n; c += Vec::size()) vm = at::vec::maximum(vm, Vec::loadu(x + c));
  alignas(64) float lanes[Vec::size()];
  vm.store(lanes);
  float m = lanes[0];
  for (int l = 1; l < Vec::size(); ++l) m = std::max(m, lanes[l]);
  for (; c < n; ++c) m = std::max(m, x[c]);
  return m;
}

// x <- exp(x - m) in place; returns the sum
inline float exp_sum(float* x, int n, float m) {
  int c = 0;
  Vec vs(0.0f), vm(m);
  for (; c + Vec::size() <= n; c += Vec::size()) {
    Vec e = (Vec::loadu(x + c) - vm).exp_u20();
    e.store(x + c);
    vs = vs + e;
  }
  alignas(64) float lanes[Vec::size()];
  vs.store(lanes);
  float s = 0.0f;
  for (int l = 0; l < Vec::size(); ++l) s += lanes[l];
  for (; c < n; ++c) {
    x[c] = std::exp(x[c] - m);
    s += x[c];
  }
  return s;
}

}  // namespace

// q: [B, H, n_qb*bq, D], k: [B, H_kv, n_kb*bk, D], v: [B, H_kv, n_kb*bk, Dv] (float32, contiguous, padded);
// indptr: [B*H*n_qb + 1], indices: [nnz] (int64, ascending per unit) -> out [B, H, n_qb*bq, Dv].
// A key at position p is visible from query row r of q-block i when p <= i*bq + r + off and p < T_k.
at::Tensor block_flash_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& indptr, const at::Tensor& indices, int64_t bq, int64_t bk,
                               int64_t off, int64_t T_k, double scale, int64_t kv_tile) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "block_flash: float32 only");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "block_flash: contiguous inputs");
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3);
  const int64_t H_kv = k.size(1), Tk = k.size(2), Dv = v.size(3);
  const int64_t n_qb = Tq / bq, n_kb = Tk / bk, g = H / H_kv;
  TORCH_CHECK(indptr.numel() == B * H * n_qb + 1, "block_flash: indptr size");
  auto out = at::empty({B, H, Tq, Dv}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* ip = indptr.data_ptr<int64_t>();
  const int64_t* ix = indices.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t tile = std::max<int64_t>(bk, kv_tile / bk * bk);  // keys per softmax step
  const float ninf = -std::numeric_limits<float>::infinity();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, B * H * n_qb, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> S(bq * tile), mrow(bq), lrow(bq), acc(bq * Dv);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t bh = u / n_qb, i = u % n_qb, b = bh / H, h = bh % H;
      const float* Q = qp + (bh * Tq + i * bq) * D;
      const float* K = kp + ((b * H_kv + h / g) * Tk) * D;
      const float* V = vp + ((b * H_kv + h / g) * Tk) * Dv;
      float* O = op + (bh * Tq + i * bq) * Dv;
      std::fill(mrow.begin(), mrow.end(), ninf);
      std::fill(lrow.begin(), lrow.end(), 0.0f);
      std::fill(acc.begin(), acc.end(), 0.0f);
      const int64_t q0 = i * bq + off;  // position of the unit's first query
      int64_t t = ip[u];
      const int64_t t_end = ip[u + 1];
      while (t < t_end) {
        // one softmax step: up to `tile` keys = the next blocks of the list
        const int64_t nb = std::min<int64_t>(tile / bk, t_end - t);
        const int N = static_cast<int>(nb * bk);
        bool partial = false;
        for (int64_t a = 0; a < nb;) {  // runs of adjacent blocks: one GEMM each
          int64_t e = a + 1;
          while (e < nb && ix[t + e] == ix[t + e - 1] + 1) ++e;
          const int64_t j = ix[t + a];
          gemm_abt(static_cast<int>(bq), static_cast<int>((e - a) * bk), static_cast<int>(D), fscale, Q,
                   static_cast<int>(D), K + j * bk * D, static_cast<int>(D), 0.0f, S.data() + a * bk, N);
          for (int64_t c = a; c < e; ++c) {
            const int64_t jj = ix[t + c];
            if ((jj + 1) * bk - 1 > q0 || (jj + 1) * bk > T_k) partial = true;
          }
          a = e;
        }
        if (partial) {  // element mask of the blocks crossing the diagonal or holding padded keys
          for (int64_t c = 0; c < nb; ++c) {
            const int64_t jj = ix[t + c], p0 = jj * bk;
            if (!((jj + 1) * bk - 1 > q0 || (jj + 1) * bk > T_k)) continue;
            for (int64_t r = 0; r < bq; ++r) {
              float* row = S.data() + r * N + c * bk;
              const int64_t lim = std::min<int64_t>(q0 + r + 1, T_k);  // visible keys: p < lim
              for (int64_t x = std::max<int64_t>(lim - p0, 0); x < bk; ++x) row[x] = ninf;
            }
          }
        }
        for (int64_t r = 0; r < bq; ++r) {
          float* row = S.data() + r * N;
          const float mnew = std::max(mrow[r], row_max(row, N));
          if (mnew == ninf) {  // nothing visible yet in this row: P = 0
            std::fill(row, row + N, 0.0f);
            continue;
          }
          const float alpha = std::exp(mrow[r] - mnew);  // 0 when m was -inf
          const float s = exp_sum(row, N, mnew);
          lrow[r] = lrow[r] * alpha + s;
          mrow[r] = mnew;
          if (alpha != 1.0f) {
            float* o = acc.data() + r * Dv;
            for (int64_t d = 0; d < Dv; ++d) o[d] *= alpha;
          }
        }
        for (int64_t a = 0; a < nb;) {
          int64_t e = a + 1;
          while (e < nb && ix[t + e] == ix[t + e - 1] + 1) ++e;
          const int64_t j = ix[t + a];
          gemm_ab(static_cast<int>(bq), static_cast<int>(Dv), static_cast<int>((e - a) * bk), S.data() + a * bk,
                  N, V + j * bk * Dv, static_cast<int>(Dv), 1.0f, acc.data(), static_cast<int>(Dv));
          a = e;
        }
        t += nb;
      }
      for (int64_t r = 0; r < bq; ++r) {
        const float inv = lrow[r] > 0.0f ? 1.0f / lrow[r] : 0.0f;
        for (int64_t d = 0; d < Dv; ++d) O[r * Dv + d] = acc[r * Dv + d] * inv;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_flash_forward", &block_flash_forward, "block-sparse causal flash attention (CPU, fp32)");
}
