// Flash attention on the CPU, forward and backward, in O(tokens) memory.
//
// Packed documents (cu_seqlens), causal or bidirectional, sliding windows, logit soft-capping
// (Gemma 2), grouped-query heads, a value head size of its own (latent attention), and the
// fp32 log-sum-exp of every query row. Each document's queries are walked in blocks; the keys
// a block may see are walked in blocks too, with an online softmax (forward) or from the saved
// log-sum-exp (backward), so no (tokens x tokens) matrix ever exists.
//
// Rows of a block stack the query heads that share one key/value head (row = token * heads +
// head), so one GEMM serves the whole group. GEMMs are fp32 (cpublas: MKL/OpenBLAS), inputs
// are converted block by block; sums are fp32 whatever the input dtype.
//
// Masks: key j of a document may be seen by its query i when, with d = i + offset - j,
//   causal: 0 <= d (< window if windowed);  bidirectional: |d| < window (all keys if none).
// `offsets` (one per document) places a query block after a key block, as context parallel's
// ring does with its chunks; it is 0 for self-attention.
//
// Work is spread with OpenMP dynamic scheduling over (document, kv head, query block) in the
// forward and over (document, kv head, query-head slice) in the backward, whose items own
// their dq rows and add their dk/dv into fp32 buffers under a lock (only where a document's
// heads were split to feed every thread).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <vector>

namespace mindspeed_ops_cpu {
namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kVec = fVec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kRows = 256;     // query rows (tokens x grouped heads) per block
constexpr int64_t kKeys = 128;     // keys per block

// Fortran BLAS sgemm as torch's own library exports it (MKL on x86 wheels, OpenBLAS on
// others), looked up at run time so that a torch without it still loads these kernels.
using SgemmFn = void (*)(const char*, const char*, const int*, const int*, const int*,
                         const float*, const float*, const int*, const float*, const int*,
                         const float*, float*, const int*);

SgemmFn find_sgemm() {
  static const SgemmFn fn = [] {
    void* self = dlopen("libtorch_cpu.so", RTLD_NOLOAD | RTLD_LAZY);
    void* found = self ? dlsym(self, "sgemm_") : nullptr;
    if (!found) found = dlsym(RTLD_DEFAULT, "sgemm_");
    return reinterpret_cast<SgemmFn>(found);
  }();
  return fn;
}

// Row-major C (m x n, ldc) = alpha * op(A) op(B) + beta * C, op(A) m x k, op(B) k x n.
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (SgemmFn sgemm = find_sgemm()) {
    // Column-major BLAS sees each row-major buffer transposed: C^T = op(B)^T op(A)^T.
    const char tra = tb ? 'T' : 'N', trb = ta ? 'T' : 'N';
    const int mm = static_cast<int>(n), nn = static_cast<int>(m), kk = static_cast<int>(k);
    const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
    sgemm(&tra, &trb, &mm, &nn, &kk, &alpha, b, &la, a, &lb, &beta, c, &lc);
    return;
  }
  auto opts = at::TensorOptions().dtype(at::kFloat);
  at::Tensor am = at::from_blob(const_cast<float*>(a), {ta ? k : m, ta ? m : k}, {lda, 1}, opts);
  at::Tensor bm = at::from_blob(const_cast<float*>(b), {tb ? n : k, tb ? k : n}, {ldb, 1}, opts);
  at::Tensor cm = at::from_blob(c, {m, n}, {ldc, 1}, opts);
  cm.addmm_(ta ? am.t() : am, tb ? bm.t() : bm, beta, alpha);
}

template <typename T>
void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
void from_float(const float* src, T* dst, int64_t n, float scale = 1.0f) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i] * scale);
}

// Which keys query i (document-local) may see: [lo, hi).
struct Mask {
  bool causal;
  int64_t window;  // <= 0: none

  int64_t lo(int64_t i, int64_t offset) const {
    if (window <= 0) return 0;
    return std::max<int64_t>(0, i + offset - window + 1);
  }
  int64_t hi(int64_t i, int64_t offset, int64_t nk) const {
    int64_t end = nk;
    if (causal) {
      end = i + offset + 1;
    } else if (window > 0) {
      end = i + offset + window;
    }
    return std::max<int64_t>(0, std::min(end, nk));
  }
};

struct Doc {
  int64_t q0, nq, k0, nk, offset;
};

struct Shape {
  int64_t hq, hkv, group, d, dv;
};

// The documents with at least one query.
std::vector<Doc> documents(const at::Tensor& cu_q, const at::Tensor& cu_k,
                           const at::Tensor& offsets) {
  auto cq = cu_q.to(at::kLong).contiguous();
  auto ck = cu_k.to(at::kLong).contiguous();
  auto off = offsets.to(at::kLong).contiguous();
  const int64_t* pq = cq.data_ptr<int64_t>();
  const int64_t* pk = ck.data_ptr<int64_t>();
  const int64_t* po = off.data_ptr<int64_t>();
  std::vector<Doc> docs;
  for (int64_t i = 0; i + 1 < cq.numel(); ++i) {
    if (pq[i + 1] > pq[i]) {
      docs.push_back({pq[i], pq[i + 1] - pq[i], pk[i], pk[i + 1] - pk[i], po[i]});
    }
  }
  return docs;
}

// Scores of a (rows x keys) block: scale, soft cap (keeping tanh for the backward), mask.
// `tanh_out` may be null (forward). Rows are (token, head) with `heads` heads per token.
void score_block(float* s, float* tanh_out, int64_t rows, int64_t keys, int64_t heads,
                 int64_t t0, int64_t j0, int64_t offset, int64_t nk, const Mask& mask,
                 float softcap, bool full) {
  const int64_t n = rows * keys;
  if (softcap > 0) {
    const fVec cap(softcap), inv(1.0f / softcap);
    int64_t i = 0;
    for (; i + kVec <= n; i += kVec) {
      fVec t = (fVec::loadu(s + i) * inv).tanh();
      if (tanh_out) t.store(tanh_out + i);
      (t * cap).store(s + i);
    }
    for (; i < n; ++i) {
      float t = std::tanh(s[i] / softcap);
      if (tanh_out) tanh_out[i] = t;
      s[i] = t * softcap;
    }
  }
  if (full) return;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = t0 + r / heads;
    const int64_t lo = std::clamp<int64_t>(mask.lo(i, offset) - j0, 0, keys);
    const int64_t hi = std::clamp<int64_t>(mask.hi(i, offset, nk) - j0, lo, keys);
    float* row = s + r * keys;
    std::fill(row, row + lo, kNegInf);
    std::fill(row + hi, row + keys, kNegInf);
  }
}

// Whether every (query, key) pair of the block is allowed (no mask to apply).
bool block_full(const Mask& mask, int64_t t0, int64_t t1, int64_t j0, int64_t j1,
                int64_t offset, int64_t nk) {
  return j0 >= mask.lo(t1 - 1, offset) && j1 <= mask.hi(t0, offset, nk);
}

// Copies rows (token t, head h of group g) of x (tokens, heads_total, width) into a dense
// fp32 (tokens * heads, width) block, starting at head `h0` of the group.
template <typename T>
void gather_rows(const T* x, float* out, int64_t t0, int64_t t1, int64_t head0, int64_t heads,
                 int64_t heads_total, int64_t width) {
  for (int64_t t = t0; t < t1; ++t) {
    to_float(x + (t * heads_total + head0) * width, out + (t - t0) * heads * width,
             heads * width);
  }
}

template <typename T>
void forward_item(const T* q, const float* kf, const float* vf, T* out, float* lse,
                  const Doc& doc, const Shape& sh, int64_t g, int64_t t0, int64_t t1,
                  int64_t total_q, const Mask& mask, float softcap, float scale) {
  const int64_t heads = sh.group, rows = (t1 - t0) * heads;
  std::vector<float> qb(rows * sh.d), acc(rows * sh.dv, 0.0f), s(rows * kKeys);
  std::vector<float> m(rows, kNegInf), l(rows, 0.0f);
  gather_rows(q, qb.data(), doc.q0 + t0, doc.q0 + t1, g * heads, heads, sh.hq, sh.d);
  const int64_t klo = mask.lo(t0, doc.offset), khi = mask.hi(t1 - 1, doc.offset, doc.nk);
  const int64_t kstride = sh.hkv * sh.d, vstride = sh.hkv * sh.dv;
  for (int64_t j0 = klo; j0 < khi; j0 += kKeys) {
    const int64_t j1 = std::min(j0 + kKeys, khi), keys = j1 - j0;
    const float* kb = kf + (doc.k0 + j0) * kstride + g * sh.d;
    const float* vb = vf + (doc.k0 + j0) * vstride + g * sh.dv;
    gemm(false, true, rows, keys, sh.d, scale, qb.data(), sh.d, kb, kstride, 0.0f, s.data(),
         keys);
    score_block(s.data(), nullptr, rows, keys, heads, t0, j0, doc.offset, doc.nk, mask,
                softcap, block_full(mask, t0, t1, j0, j1, doc.offset, doc.nk));
    for (int64_t r = 0; r < rows; ++r) {
      float* row = s.data() + r * keys;
      const float block_max = at::vec::reduce_all<float>(
          [](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, row, keys);
      const float m_new = std::max(m[r], block_max);
      if (m_new == kNegInf) {  // no key seen by this row yet
        std::fill(row, row + keys, 0.0f);
        continue;
      }
      const fVec shift(m_new);
      at::vec::map([&](fVec x) { return (x - shift).exp_u20(); }, row, row, keys);
      const float sum = at::vec::reduce_all<float>([](fVec& a, fVec& b) { return a + b; },
                                                   row, keys);
      const float correction = std::exp(m[r] - m_new);  // 0 while m[r] is -inf
      l[r] = l[r] * correction + sum;
      if (correction != 1.0f) {
        float* a = acc.data() + r * sh.dv;
        at::vec::map([correction](fVec x) { return x * fVec(correction); }, a, a, sh.dv);
      }
      m[r] = m_new;
    }
    gemm(false, false, rows, sh.dv, keys, 1.0f, s.data(), keys, vb, vstride, 1.0f, acc.data(),
         sh.dv);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = doc.q0 + t0 + r / heads, h = g * heads + r % heads;
    const float inv = l[r] > 0 ? 1.0f / l[r] : 0.0f;
    from_float(acc.data() + r * sh.dv, out + (t * sh.hq + h) * sh.dv, sh.dv, inv);
    lse[h * total_q + t] = l[r] > 0 ? m[r] + std::log(l[r]) : kNegInf;
  }
}

// Where an item's dk/dv go: written straight into dk/dv (an item owns its document's kv
// head), or added into fp32 sums under a lock (a document's query heads split over items).
template <typename T>
struct KVGrads {
  T* dk;
  T* dv;
  float* dk_sum;  // null: write straight
  float* dv_sum;
  std::mutex* lock;
};

template <typename T, typename O>
void backward_item(const T* dout, const float* dlse, const T* q, const float* kf,
                   const float* vf, const O* out, const float* lse, T* dq,
                   const KVGrads<T>& grads, const Doc& doc, const Shape& sh, int64_t g,
                   int64_t h0, int64_t heads, int64_t total_q, const Mask& mask, float softcap,
                   float scale) {
  const int64_t block_tokens = std::max<int64_t>(1, kRows / heads);
  const int64_t kstride = sh.hkv * sh.d, vstride = sh.hkv * sh.dv;
  const int64_t max_rows = block_tokens * heads;
  std::vector<float> dk_acc(doc.nk * sh.d, 0.0f), dv_acc(doc.nk * sh.dv, 0.0f);
  std::vector<float> qb(max_rows * sh.d), dob(max_rows * sh.dv), ob(max_rows * sh.dv);
  std::vector<float> dqb(max_rows * sh.d), p(max_rows * kKeys), dp(max_rows * kKeys);
  std::vector<float> th(softcap > 0 ? max_rows * kKeys : 0), lse_b(max_rows), delta(max_rows);
  const int64_t head0 = g * sh.group + h0;
  for (int64_t t0 = 0; t0 < doc.nq; t0 += block_tokens) {
    const int64_t t1 = std::min(t0 + block_tokens, doc.nq), rows = (t1 - t0) * heads;
    gather_rows(q, qb.data(), doc.q0 + t0, doc.q0 + t1, head0, heads, sh.hq, sh.d);
    gather_rows(dout, dob.data(), doc.q0 + t0, doc.q0 + t1, head0, heads, sh.hq, sh.dv);
    gather_rows(out, ob.data(), doc.q0 + t0, doc.q0 + t1, head0, heads, sh.hq, sh.dv);
    for (int64_t r = 0; r < rows; ++r) {  // delta = <dout, out> - dlse per row
      const int64_t t = doc.q0 + t0 + r / heads, h = head0 + r % heads;
      lse_b[r] = lse[h * total_q + t];
      delta[r] = at::vec::map2_reduce_all<float>(
          [](fVec a, fVec b) { return a * b; }, [](fVec a, fVec b) { return a + b; },
          dob.data() + r * sh.dv, ob.data() + r * sh.dv, sh.dv);
      if (dlse) delta[r] -= dlse[h * total_q + t];
    }
    std::fill(dqb.begin(), dqb.begin() + rows * sh.d, 0.0f);
    const int64_t klo = mask.lo(t0, doc.offset), khi = mask.hi(t1 - 1, doc.offset, doc.nk);
    for (int64_t j0 = klo; j0 < khi; j0 += kKeys) {
      const int64_t j1 = std::min(j0 + kKeys, khi), keys = j1 - j0;
      const float* kb = kf + (doc.k0 + j0) * kstride + g * sh.d;
      const float* vb = vf + (doc.k0 + j0) * vstride + g * sh.dv;
      gemm(false, true, rows, keys, sh.d, scale, qb.data(), sh.d, kb, kstride, 0.0f, p.data(),
           keys);
      score_block(p.data(), softcap > 0 ? th.data() : nullptr, rows, keys, heads, t0, j0,
                  doc.offset, doc.nk, mask, softcap,
                  block_full(mask, t0, t1, j0, j1, doc.offset, doc.nk));
      for (int64_t r = 0; r < rows; ++r) {  // P = exp(s - lse)
        float* row = p.data() + r * keys;
        if (lse_b[r] == kNegInf) {
          std::fill(row, row + keys, 0.0f);
          continue;
        }
        const fVec shift(lse_b[r]);
        at::vec::map([&](fVec x) { return (x - shift).exp_u20(); }, row, row, keys);
      }
      // dV += P^T dO; dP = dO V^T
      gemm(true, false, keys, sh.dv, rows, 1.0f, p.data(), keys, dob.data(), sh.dv, 1.0f,
           dv_acc.data() + j0 * sh.dv, sh.dv);
      gemm(false, true, rows, keys, sh.dv, 1.0f, dob.data(), sh.dv, vb, vstride, 0.0f,
           dp.data(), keys);
      for (int64_t r = 0; r < rows; ++r) {  // dS = P (dP - delta) [* (1 - tanh^2)]
        float* ds = dp.data() + r * keys;
        const float* pr = p.data() + r * keys;
        const fVec dr(delta[r]);
        if (softcap > 0) {
          const float* tr = th.data() + r * keys;
          at::vec::map3([&](fVec x, fVec pp, fVec t) {
            return pp * (x - dr) * (fVec(1.0f) - t * t);
          }, ds, ds, pr, tr, keys);
        } else {
          at::vec::map2([&](fVec x, fVec pp) { return pp * (x - dr); }, ds, ds, pr, keys);
        }
      }
      // dQ += dS K; dK += dS^T Q (both times scale, applied once at the end)
      gemm(false, false, rows, sh.d, keys, 1.0f, dp.data(), keys, kb, kstride, 1.0f,
           dqb.data(), sh.d);
      gemm(true, false, keys, sh.d, rows, 1.0f, dp.data(), keys, qb.data(), sh.d, 1.0f,
           dk_acc.data() + j0 * sh.d, sh.d);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = doc.q0 + t0 + r / heads, h = head0 + r % heads;
      from_float(dqb.data() + r * sh.d, dq + (t * sh.hq + h) * sh.d, sh.d, scale);
    }
  }
  for (int64_t j = 0; j < doc.nk; ++j) {
    const int64_t row = (doc.k0 + j) * sh.hkv + g;
    const float* ka = dk_acc.data() + j * sh.d;
    const float* va = dv_acc.data() + j * sh.dv;
    if (grads.dk_sum == nullptr) {
      from_float(ka, grads.dk + row * sh.d, sh.d, scale);
      from_float(va, grads.dv + row * sh.dv, sh.dv);
      continue;
    }
    std::lock_guard<std::mutex> guard(*grads.lock);
    float* dkr = grads.dk_sum + row * sh.d;
    float* dvr = grads.dv_sum + row * sh.dv;
    for (int64_t c = 0; c < sh.d; ++c) dkr[c] += ka[c] * scale;
    for (int64_t c = 0; c < sh.dv; ++c) dvr[c] += va[c];
  }
}

struct BwdItem {
  int64_t doc, g, h0, heads, cost;
};

template <typename T, typename O>
void backward_all(const at::Tensor& dout, const float* dlse, const at::Tensor& q,
                  const at::Tensor& kf, const at::Tensor& vf, const O* out,
                  const at::Tensor& lse, at::Tensor& dq, const KVGrads<T>& grads,
                  const std::vector<Doc>& docs, const std::vector<BwdItem>& items,
                  const Shape& sh, const Mask& mask, double softcap, double scale) {
  const T *dop = dout.data_ptr<T>(), *qp = q.data_ptr<T>();
  const float *kp = kf.data_ptr<float>(), *vp = vf.data_ptr<float>();
  const float* lp = lse.data_ptr<float>();
  T* dqp = dq.data_ptr<T>();
  const int64_t n = static_cast<int64_t>(items.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) {
    const BwdItem& it = items[i];
    backward_item<T, O>(dop, dlse, qp, kp, vp, out, lp, dqp, grads, docs[it.doc], sh, it.g,
                        it.h0, it.heads, q.size(0), mask, static_cast<float>(softcap),
                        static_cast<float>(scale));
  }
}

// fp32 (tokens, heads, width) copy of x, or x itself when it already is one.
at::Tensor as_float(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "flash_attention: q, k, v must be (tokens, heads, head_dim)");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "flash_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "flash_attention: q, k, v must share a dtype");
  TORCH_CHECK(k.size(0) == v.size(0) && k.size(1) == v.size(1) && q.size(2) == k.size(2),
              "flash_attention: k/v tokens and heads, and q/k head_dim must agree");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "flash_attention: query heads must be a multiple of kv heads");
}

Shape shape_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return {q.size(1), k.size(1), q.size(1) / k.size(1), q.size(2), v.size(2)};
}

}  // namespace

std::vector<at::Tensor> flash_attention_fwd(const at::Tensor& q_in, const at::Tensor& k,
                                            const at::Tensor& v, const at::Tensor& cu_q,
                                            const at::Tensor& cu_k, const at::Tensor& offsets,
                                            bool causal, int64_t window, double softcap,
                                            double scale) {
  check_inputs(q_in, k, v);
  const at::Tensor q = q_in.contiguous();
  const Shape sh = shape_of(q, k, v);
  const at::Tensor kf = as_float(k), vf = as_float(v);
  at::Tensor out = at::zeros({q.size(0), sh.hq, sh.dv}, q.options());
  at::Tensor lse = at::full({sh.hq, q.size(0)}, kNegInf, q.options().dtype(at::kFloat));
  const std::vector<Doc> docs = documents(cu_q, cu_k, offsets);
  const Mask mask{causal, window};
  const int64_t block_tokens = std::max<int64_t>(1, kRows / sh.group);
  struct Item {
    int64_t doc, g, t0, t1;
  };
  std::vector<Item> items;
  for (int64_t d = 0; d < static_cast<int64_t>(docs.size()); ++d) {
    for (int64_t g = 0; g < sh.hkv; ++g) {
      for (int64_t t0 = 0; t0 < docs[d].nq; t0 += block_tokens) {
        items.push_back({d, g, t0, std::min(t0 + block_tokens, docs[d].nq)});
      }
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "flash_fwd", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const float *kp = kf.data_ptr<float>(), *vp = vf.data_ptr<float>();
    float* lp = lse.data_ptr<float>();
    const int64_t n = static_cast<int64_t>(items.size());
_Pragma("omp parallel for schedule(dynamic, 1)")
    for (int64_t i = n - 1; i >= 0; --i) {  // late (costly) causal blocks first
      const Item& it = items[i];
      forward_item<scalar_t>(qp, kp, vp, op, lp, docs[it.doc], sh, it.g, it.t0, it.t1,
                             q.size(0), mask, static_cast<float>(softcap),
                             static_cast<float>(scale));
    }
  });
  return {out, lse};
}

std::vector<at::Tensor> flash_attention_bwd(
    const at::Tensor& dout_in, const c10::optional<at::Tensor>& dlse_in, const at::Tensor& q_in,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out_in, const at::Tensor& lse_in,
    const at::Tensor& cu_q, const at::Tensor& cu_k, const at::Tensor& offsets, bool causal,
    int64_t window, double softcap, double scale) {
  check_inputs(q_in, k, v);
  // out in its own dtype if fp32 (context parallel's ring hands over its merged fp32 output),
  // else in q's; dout in q's. Both are read block by block (no fp32 copies of them).
  const at::Tensor q = q_in.contiguous();
  const bool out_fp32 = out_in.scalar_type() == at::kFloat;
  const at::Tensor out = (out_fp32 ? out_in : out_in.to(q.scalar_type())).contiguous();
  const at::Tensor dout = dout_in.to(q.scalar_type()).contiguous();
  const at::Tensor lse = lse_in.to(at::kFloat).contiguous();
  at::Tensor dlse;
  if (dlse_in.has_value() && dlse_in->defined()) dlse = dlse_in->to(at::kFloat).contiguous();
  const Shape sh = shape_of(q, k, v);
  TORCH_CHECK(out.sizes() == dout.sizes() && out.size(2) == sh.dv,
              "flash_attention_bwd: out/dout must be (tokens, heads, v_head_dim)");
  const at::Tensor kf = as_float(k), vf = as_float(v);
  at::Tensor dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  const std::vector<Doc> docs = documents(cu_q, cu_k, offsets);
  const Mask mask{causal, window};
  // Split a document's query heads when there are fewer (document, kv head) pairs than threads.
  const int64_t threads = at::get_num_threads();
  const int64_t pairs = std::max<int64_t>(1, static_cast<int64_t>(docs.size()) * sh.hkv);
  const int64_t split = std::min<int64_t>(sh.group, (threads + pairs - 1) / pairs);
  std::vector<BwdItem> items;
  for (int64_t d = 0; d < static_cast<int64_t>(docs.size()); ++d) {
    for (int64_t g = 0; g < sh.hkv; ++g) {
      for (int64_t s = 0; s < split; ++s) {
        const int64_t h0 = sh.group * s / split, h1 = sh.group * (s + 1) / split;
        if (h1 > h0) items.push_back({d, g, h0, h1 - h0, docs[d].nq * docs[d].nk * (h1 - h0)});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const BwdItem& a, const BwdItem& b) { return a.cost > b.cost; });
  std::mutex lock;
  at::Tensor dk_sum, dv_sum;  // only when heads are split over items
  if (split > 1) {
    dk_sum = at::zeros(k.sizes(), k.options().dtype(at::kFloat));
    dv_sum = at::zeros(v.sizes(), v.options().dtype(at::kFloat));
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "flash_bwd", [&] {
    const KVGrads<scalar_t> grads{dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(),
                                  split > 1 ? dk_sum.data_ptr<float>() : nullptr,
                                  split > 1 ? dv_sum.data_ptr<float>() : nullptr, &lock};
    const float* dlp = dlse.defined() ? dlse.data_ptr<float>() : nullptr;
    if (out_fp32) {
      backward_all<scalar_t, float>(dout, dlp, q, kf, vf, out.data_ptr<float>(), lse, dq, grads,
                                    docs, items, sh, mask, softcap, scale);
    } else {
      backward_all<scalar_t, scalar_t>(dout, dlp, q, kf, vf, out.data_ptr<scalar_t>(), lse, dq,
                                       grads, docs, items, sh, mask, softcap, scale);
    }
  });
  if (split > 1) {
    dk.copy_(dk_sum);
    dv.copy_(dv_sum);
  }
  return {dq, dk, dv};
}

}  // namespace mindspeed_ops_cpu
