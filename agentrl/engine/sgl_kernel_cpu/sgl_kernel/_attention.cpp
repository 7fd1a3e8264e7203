// Paged decode attention for SGLang's CPU path, compiled on the machine that runs it (_native.py).
//
// SGLang's torch-native backend (and our batched PyTorch path) copies every request's keys and values out of the
// paged KV cache before attending: one query row per request against a few hundred cached rows, so the copy, the
// padding to the longest request and the masked SDPA call cost more than the arithmetic (on an AVX-512 EPYC in bf16,
// 17-24 ms a layer call for 32 requests, ~35 MFLOP). This kernel reads the cached rows in place through
// req_to_token, once each, and accumulates in fp32 (a numerically safe two-pass softmax).
//
// Op: agentrl_cpu::decode_attention(q [n, H, D], out [n, H, D] (written), k_cache [P, KV, D], v_cache [P, KV, D],
//     req_to_token [R, C] int32, req_pool_indices [n] int64, seq_lens [n] int64, scale). H a multiple of KV (grouped
//     queries); q, out, k_cache, v_cache of one dtype (float32, bfloat16 or float16), unit stride on the last axis.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float as_float(T x) {
  return static_cast<float>(x);
}

template <typename T>
void decode(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
            double scale) {
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(1);
  const int64_t group = heads / kv_heads, slots = k_cache.size(0), width = req_to_token.size(1);
  const int64_t table_rows = req_to_token.size(0);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* table = req_to_token.data_ptr<int32_t>();
  const int64_t* rows = req_pool_indices.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), vs0 = v_cache.stride(0), vs1 = v_cache.stride(1);
  const int64_t ts0 = req_to_token.stride(0);
  const float fscale = static_cast<float>(scale);

  // One request a task: its cached rows are read in order, every KV head of a row together (a row of all heads is
  // contiguous in the cache, and a request's slots mostly are too), so the hardware prefetcher streams them.
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(heads * dim), acc(heads * dim), scores, inv(heads);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t len = lens[i], row = rows[i];
      // an index out of range would read outside the tensors: refuse it (the error reaches the caller)
      TORCH_CHECK(len >= 0 && len <= width && row >= 0 && row < table_rows, "decode_attention: request ", i,
                  " has seq_len ", len, " and table row ", row, " (table ", table_rows, " x ", width, ")");
      const int32_t* toks = table + row * ts0;
      for (int64_t t = 0; t < len; ++t)
        TORCH_CHECK(toks[t] >= 0 && toks[t] < slots, "decode_attention: request ", i, " position ", t,
                    " points at KV slot ", toks[t], " of ", slots);
      for (int64_t h = 0; h < heads; ++h) {
        const T* src = qp + i * qs0 + h * qs1;
        for (int64_t d = 0; d < dim; ++d) qf[h * dim + d] = as_float(src[d]) * fscale;
      }
      scores.resize(heads * len);  // [heads, len]
      for (int64_t t = 0; t < len; ++t) {
        const T* kt = kp + static_cast<int64_t>(toks[t]) * ks0;
        for (int64_t h = 0; h < heads; ++h) {
          const T* kr = kt + (h / group) * ks1;
          const float* qh = qf.data() + h * dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)  // lets the compiler reorder the sum (vector lanes), as any BLAS does
          for (int64_t d = 0; d < dim; ++d) s += qh[d] * as_float(kr[d]);
          scores[h * len + t] = s;
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* sh = scores.data() + h * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) m = std::max(m, sh[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          sh[t] = std::exp(sh[t] - m);
          sum += sh[t];
        }
        inv[h] = sum > 0.f ? 1.f / sum : 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* vt = vp + static_cast<int64_t>(toks[t]) * vs0;
        for (int64_t h = 0; h < heads; ++h) {
          const T* vr = vt + (h / group) * vs1;
          const float p = scores[h * len + t];
          float* ah = acc.data() + h * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) ah[d] += p * as_float(vr[d]);
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        T* dst = op + i * os0 + h * os1;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[h * dim + d] * inv[h]);
      }
    }
  });
}

void decode_attention(const at::Tensor& q, at::Tensor out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                      double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "decode_attention: q and out must be [n, heads, dim]");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == q.size(2),
              "decode_attention: k_cache and v_cache must be [slots, kv_heads, dim] with q's dim");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "decode_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(q.scalar_type() == out.scalar_type() && q.scalar_type() == k_cache.scalar_type() &&
                  q.scalar_type() == v_cache.scalar_type(),
              "decode_attention: q, out, k_cache and v_cache must have one dtype");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1,
              "decode_attention: the last axis must be contiguous");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.dim() == 2 && req_to_token.stride(1) == 1,
              "decode_attention: req_to_token must be a row-contiguous int32 table");
  TORCH_CHECK(req_pool_indices.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  req_pool_indices.is_contiguous() && seq_lens.is_contiguous() &&
                  req_pool_indices.numel() == q.size(0) && seq_lens.numel() == q.size(0),
              "decode_attention: req_pool_indices and seq_lens must be contiguous int64 of n entries");
  switch (q.scalar_type()) {
    case at::kFloat:
      decode<float>(q, out, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scale);
      break;
    case at::kBFloat16:
      decode<c10::BFloat16>(q, out, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scale);
      break;
    case at::kHalf:
      decode<c10::Half>(q, out, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scale);
      break;
    default:
      TORCH_CHECK(false, "decode_attention: dtype ", q.scalar_type(), " is not float32, bfloat16 or float16");
  }
}

}  // namespace

TORCH_LIBRARY(agentrl_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor(a!) out, Tensor k_cache, Tensor v_cache, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(agentrl_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
