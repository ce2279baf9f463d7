// CPU kernels of mindspeed-ops: rms_norm, swiglu and rotary embedding, forward and backward;
// NF4 quantise/dequantise; the few-row linear layer of decoding (skinny_linear); flash
// attention (flash_attention.cpp).
//
// Inputs are fp32 or bf16; every sum and every product is taken in fp32. Rows are spread over
// OpenMP threads with at::parallel_for and each row is walked with at::vec::Vectorized<float>.
// The Python wrappers validate shapes and dtypes first; the TORCH_CHECKs here are a second line
// of defence so that a bad call is an exception, never a crash. Their messages hold only
// strings: with some torch builds (seen with torch 2.11 wheels and GCC 13) a TORCH_CHECK that
// formats a number in an extension segfaults while throwing.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

// skinny_linear.cpp
namespace mindspeed_ops_cpu {
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale);
bool skinny_linear_simd();
// flash_attention.cpp
std::vector<at::Tensor> flash_attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, const at::Tensor& cu_q,
                                            const at::Tensor& cu_k, const at::Tensor& offsets,
                                            bool causal, int64_t window, double softcap,
                                            double scale);
std::vector<at::Tensor> flash_attention_bwd(
    const at::Tensor& dout, const c10::optional<at::Tensor>& dlse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& cu_q, const at::Tensor& cu_k, const at::Tensor& offsets, bool causal,
    int64_t window, double softcap, double scale);
}  // namespace mindspeed_ops_cpu

namespace {

using at::vec::Vectorized;
using fVec = Vectorized<float>;
constexpr int64_t kVec = fVec::size();

// Load/store kVec elements of T as fp32 (a partial count zero-fills the rest).
template <typename T>
struct IO;

template <>
struct IO<float> {
  static fVec load(const float* p, int64_t n = kVec) {
    return n == kVec ? fVec::loadu(p) : fVec::loadu(p, n);
  }
  static void store(float* p, const fVec& v, int64_t n = kVec) {
    if (n == kVec) {
      v.store(p);
    } else {
      v.store(p, n);
    }
  }
};

template <>
struct IO<at::BFloat16> {
  static fVec load(const at::BFloat16* p, int64_t n = kVec) {
    if (n == kVec) {
      fVec out;
      at::vec::load_fp32_from_bf16(p, out);
      return out;
    }
    float buf[kVec] = {0};
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
    return fVec::loadu(buf);
  }
  static void store(at::BFloat16* p, const fVec& v, int64_t n = kVec) {
#if defined(CPU_CAPABILITY_AVX2)
    if (n == kVec) {  // full width: one conversion and one 128-bit store, no staging buffer
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), at::vec::cvtfp32_bf16(__m256(v)));
      return;
    }
#endif
    auto b = at::vec::convert_from_float<at::BFloat16>(v, v);
    b.store(p, n);
  }
};

float sum_lanes(const fVec& v) {
  float buf[kVec];
  v.store(buf);
  float s = 0.f;
  for (int64_t i = 0; i < kVec; ++i) s += buf[i];
  return s;
}

// Calls f with a value of the C++ type of dtype (float or BFloat16).
template <typename F>
void dispatch(at::ScalarType dtype, F&& f) {
  if (dtype == at::kFloat) {
    f(float{});
  } else {
    TORCH_CHECK(dtype == at::kBFloat16, "expected float32 or bfloat16");
    f(at::BFloat16{});
  }
}

// Rows per parallel task: about 32k elements of work each.
int64_t row_grain(int64_t row_elems) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems));
}

void check_2d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D");
  TORCH_CHECK(t.stride(1) == 1, name, " must have a unit inner stride");
  TORCH_CHECK(
      t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
      name,
      " must be float32 or bfloat16");
}

// ---------------------------------------------------------------------------------------------
// rms_norm: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps); w is fp32 here (already 1 + w
// for the offset style) or absent.

template <typename T>
void rms_fwd_kernel(
    const T* x, const float* w, T* y, float* rstd, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, row_grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * hidden;
      T* yr = y + r * hidden;
      fVec acc(0.f);
      for (int64_t i = 0; i < hidden; i += kVec) {
        const int64_t n = std::min(kVec, hidden - i);
        fVec v = IO<T>::load(xr + i, n);
        acc = at::vec::fmadd(v, v, acc);
      }
      const float rs = 1.f / std::sqrt(sum_lanes(acc) / static_cast<float>(hidden) + eps);
      rstd[r] = rs;
      const fVec vrs(rs);
      for (int64_t i = 0; i < hidden; i += kVec) {
        const int64_t n = std::min(kVec, hidden - i);
        fVec v = IO<T>::load(xr + i, n) * vrs;
        if (w != nullptr) v = v * IO<float>::load(w + i, n);
        IO<T>::store(yr + i, v, n);
      }
    }
  });
}

// dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * w and xhat = x * rstd;
// dw = sum over rows of dy * xhat, accumulated per task in fp32 and summed afterwards.
template <typename T>
void rms_bwd_kernel(
    const T* dy,
    const T* x,
    const float* w,
    const float* rstd,
    T* dx,
    float* dw_parts,
    int64_t num_parts,
    int64_t rows,
    int64_t hidden) {
  at::parallel_for(0, num_parts, 1, [&](int64_t pbegin, int64_t pend) {
    for (int64_t part = pbegin; part < pend; ++part) {
      const int64_t rbegin = rows * part / num_parts;
      const int64_t rend = rows * (part + 1) / num_parts;
      float* dwp = dw_parts == nullptr ? nullptr : dw_parts + part * hidden;
      for (int64_t r = rbegin; r < rend; ++r) {
        const T* xr = x + r * hidden;
        const T* dyr = dy + r * hidden;
        T* dxr = dx + r * hidden;
        const fVec vrs(rstd[r]);
        fVec acc(0.f);
        for (int64_t i = 0; i < hidden; i += kVec) {
          const int64_t n = std::min(kVec, hidden - i);
          fVec g = IO<T>::load(dyr + i, n);
          if (w != nullptr) g = g * IO<float>::load(w + i, n);
          acc = at::vec::fmadd(g, IO<T>::load(xr + i, n) * vrs, acc);
        }
        const fVec vmean(sum_lanes(acc) / static_cast<float>(hidden));
        for (int64_t i = 0; i < hidden; i += kVec) {
          const int64_t n = std::min(kVec, hidden - i);
          const fVec d = IO<T>::load(dyr + i, n);
          const fVec xhat = IO<T>::load(xr + i, n) * vrs;
          fVec g = d;
          if (w != nullptr) g = g * IO<float>::load(w + i, n);
          IO<T>::store(dxr + i, vrs * (g - xhat * vmean), n);
          if (dwp != nullptr) {
            IO<float>::store(dwp + i, at::vec::fmadd(d, xhat, IO<float>::load(dwp + i, n)), n);
          }
        }
      }
    }
  });
}

std::vector<at::Tensor> rms_norm_fwd(
    const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps) {
  check_2d(x, "x");
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  const int64_t rows = x.size(0);
  const int64_t hidden = x.size(1);
  at::Tensor w;
  if (weight.has_value()) {
    w = weight->to(at::kFloat).contiguous();
    TORCH_CHECK(w.numel() == hidden, "weight must have one element per hidden channel");
  }
  auto y = at::empty_like(x);
  auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_fwd_kernel<scalar_t>(
        x.data_ptr<scalar_t>(),
        w.defined() ? w.data_ptr<float>() : nullptr,
        y.data_ptr<scalar_t>(),
        rstd.data_ptr<float>(),
        rows,
        hidden,
        static_cast<float>(eps));
  });
  return {y, rstd};
}

std::vector<at::Tensor> rms_norm_bwd(
    const at::Tensor& dy,
    const at::Tensor& x,
    const c10::optional<at::Tensor>& weight,
    const at::Tensor& rstd) {
  check_2d(x, "x");
  TORCH_CHECK(x.is_contiguous() && dy.is_contiguous(), "x and dy must be contiguous");
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(), "dy must match x");
  const int64_t rows = x.size(0);
  const int64_t hidden = x.size(1);
  TORCH_CHECK(rstd.numel() == rows && rstd.scalar_type() == at::kFloat, "bad rstd");
  at::Tensor w;
  at::Tensor dw_parts;
  const int64_t num_parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
  if (weight.has_value()) {
    w = weight->to(at::kFloat).contiguous();
    TORCH_CHECK(w.numel() == hidden, "weight must have one element per hidden channel");
    dw_parts = at::zeros({num_parts, hidden}, x.options().dtype(at::kFloat));
  }
  auto dx = at::empty_like(x);
  auto rstd_c = rstd.contiguous();
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_bwd_kernel<scalar_t>(
        dy.data_ptr<scalar_t>(),
        x.data_ptr<scalar_t>(),
        w.defined() ? w.data_ptr<float>() : nullptr,
        rstd_c.data_ptr<float>(),
        dx.data_ptr<scalar_t>(),
        dw_parts.defined() ? dw_parts.data_ptr<float>() : nullptr,
        num_parts,
        rows,
        hidden);
  });
  if (!dw_parts.defined()) return {dx};
  return {dx, dw_parts.sum(0)};
}

// ---------------------------------------------------------------------------------------------
// swiglu: y = silu(a) * b. a and b are [rows, hidden] views that may share one [rows, 2*hidden]
// buffer, so rows are addressed through their own strides.

fVec sigmoid(const fVec& a) {
  // exp_u20 is a fast polynomial; clamping keeps it in range, sigmoid is saturated there.
  const fVec z = at::vec::clamp(fVec(0.f) - a, fVec(-88.f), fVec(88.f));
  return fVec(1.f) / (fVec(1.f) + z.exp_u20());
}

template <typename T>
void swiglu_fwd_kernel(
    const T* a, int64_t sa, const T* b, int64_t sb, T* y, int64_t rows, int64_t hidden) {
  at::parallel_for(0, rows, row_grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < hidden; i += kVec) {
        const int64_t n = std::min(kVec, hidden - i);
        const fVec va = IO<T>::load(a + r * sa + i, n);
        const fVec vb = IO<T>::load(b + r * sb + i, n);
        IO<T>::store(y + r * hidden + i, va * sigmoid(va) * vb, n);
      }
    }
  });
}

template <typename T>
void swiglu_bwd_kernel(
    const T* dy,
    const T* a,
    int64_t sa,
    const T* b,
    int64_t sb,
    T* da,
    int64_t sda,
    T* db,
    int64_t sdb,
    int64_t rows,
    int64_t hidden) {
  at::parallel_for(0, rows, row_grain(hidden), [&](int64_t begin, int64_t end) {
    const fVec one(1.f);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < hidden; i += kVec) {
        const int64_t n = std::min(kVec, hidden - i);
        const fVec vd = IO<T>::load(dy + r * hidden + i, n);
        const fVec va = IO<T>::load(a + r * sa + i, n);
        const fVec vb = IO<T>::load(b + r * sb + i, n);
        const fVec s = sigmoid(va);
        const fVec silu = va * s;
        IO<T>::store(da + r * sda + i, vd * vb * s * (one + va * (one - s)), n);
        IO<T>::store(db + r * sdb + i, vd * silu, n);
      }
    }
  });
}

at::Tensor swiglu_fwd(const at::Tensor& a, const at::Tensor& b) {
  check_2d(a, "a");
  check_2d(b, "b");
  TORCH_CHECK(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type(), "a and b differ");
  auto y = at::empty(a.sizes(), a.options());
  dispatch(a.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    swiglu_fwd_kernel<scalar_t>(
        a.data_ptr<scalar_t>(),
        a.stride(0),
        b.data_ptr<scalar_t>(),
        b.stride(0),
        y.data_ptr<scalar_t>(),
        a.size(0),
        a.size(1));
  });
  return y;
}

// Writes into da and db, which may be the two halves of one gradient buffer.
void swiglu_bwd(
    const at::Tensor& dy, const at::Tensor& a, const at::Tensor& b, at::Tensor da, at::Tensor db) {
  check_2d(a, "a");
  check_2d(b, "b");
  check_2d(da, "da");
  check_2d(db, "db");
  TORCH_CHECK(dy.is_contiguous() && dy.sizes() == a.sizes(), "dy must be contiguous like a");
  TORCH_CHECK(
      a.sizes() == b.sizes() && da.sizes() == a.sizes() && db.sizes() == a.sizes(),
      "a, b, da and db must have one shape");
  TORCH_CHECK(
      dy.scalar_type() == a.scalar_type() && da.scalar_type() == a.scalar_type(),
      "dy, a and da must have one dtype");
  dispatch(a.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    swiglu_bwd_kernel<scalar_t>(
        dy.data_ptr<scalar_t>(),
        a.data_ptr<scalar_t>(),
        a.stride(0),
        b.data_ptr<scalar_t>(),
        b.stride(0),
        da.data_ptr<scalar_t>(),
        da.stride(0),
        db.data_ptr<scalar_t>(),
        db.stride(0),
        a.size(0),
        a.size(1));
  });
}

// ---------------------------------------------------------------------------------------------
// rotary embedding on x [tokens, heads, head_dim]; cos/sin tables are fp32 [positions, rot/2];
// position_ids [tokens] pick the row per token. sign = -1 applies the inverse rotation, which is
// the backward. Dimensions past rot are copied unchanged.

template <typename T>
void rope_kernel(
    const T* x,
    const int64_t* pos,
    const float* cos,
    const float* sin,
    T* out,
    int64_t tokens,
    int64_t heads,
    int64_t head_dim,
    int64_t half,
    bool interleaved,
    float sign) {
  const int64_t row = heads * head_dim;
  at::parallel_for(0, tokens, row_grain(row), [&](int64_t begin, int64_t end) {
    std::vector<float> sbuf(half);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + pos[t] * half;
      const float* s0 = sin + pos[t] * half;
      for (int64_t i = 0; i < half; ++i) sbuf[i] = sign * s0[i];
      const float* s = sbuf.data();
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + t * row + h * head_dim;
        T* o = out + t * row + h * head_dim;
        if (interleaved) {
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = static_cast<float>(xr[2 * i]);
            const float x2 = static_cast<float>(xr[2 * i + 1]);
            o[2 * i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
            o[2 * i + 1] = static_cast<T>(x2 * c[i] + x1 * s[i]);
          }
        } else {
          for (int64_t i = 0; i < half; i += kVec) {
            const int64_t n = std::min(kVec, half - i);
            const fVec x1 = IO<T>::load(xr + i, n);
            const fVec x2 = IO<T>::load(xr + half + i, n);
            const fVec vc = IO<float>::load(c + i, n);
            const fVec vs = IO<float>::load(s + i, n);
            IO<T>::store(o + i, x1 * vc - x2 * vs, n);
            IO<T>::store(o + half + i, at::vec::fmadd(x1, vs, x2 * vc), n);
          }
        }
        for (int64_t i = 2 * half; i < head_dim; ++i) o[i] = xr[i];
      }
    }
  });
}

at::Tensor rotary(
    const at::Tensor& x,
    const at::Tensor& position_ids,
    const at::Tensor& cos,
    const at::Tensor& sin,
    bool interleaved,
    bool inverse) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), "x must be contiguous [tokens, heads, dim]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x dtype");
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && cos.scalar_type() == at::kFloat, "cos");
  TORCH_CHECK(
      sin.sizes() == cos.sizes() && sin.is_contiguous() && sin.scalar_type() == at::kFloat,
      "sin must match cos");
  TORCH_CHECK(position_ids.dim() == 1 && position_ids.numel() == x.size(0), "position_ids");
  TORCH_CHECK(
      position_ids.scalar_type() == at::kLong && position_ids.is_contiguous(),
      "position_ids must be contiguous int64");
  const int64_t half = cos.size(1);
  TORCH_CHECK(2 * half <= x.size(2), "rotary dim exceeds head_dim");
  if (position_ids.numel() > 0) {  // read from the host memory directly: no dispatched op
    const int64_t* pos = position_ids.data_ptr<int64_t>();
    int64_t low = pos[0], high = pos[0];
    for (int64_t i = 1; i < position_ids.numel(); ++i) {
      low = std::min(low, pos[i]);
      high = std::max(high, pos[i]);
    }
    TORCH_CHECK_VALUE(
        low >= 0 && high < cos.size(0), "position_ids must lie in [0, ", cos.size(0),
        ") (the table length), got values from ", low, " to ", high);
  }
  auto out = at::empty_like(x);
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    rope_kernel<scalar_t>(
        x.data_ptr<scalar_t>(),
        position_ids.data_ptr<int64_t>(),
        cos.data_ptr<float>(),
        sin.data_ptr<float>(),
        out.data_ptr<scalar_t>(),
        x.size(0),
        x.size(1),
        x.size(2),
        half,
        interleaved,
        inverse ? -1.f : 1.f);
  });
  return out;
}

// NF4, QLoRA's 4-bit NormalFloat: each block of `block` values shares one fp32 absmax; a value
// becomes the index of the level nearest to value / absmax (the first on a tie, as argmin), two
// indices per byte, the first in the high nibble. An all-zero block (absmax 0) codes 7 (0.0).
constexpr float kNF4[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

inline uint8_t nf4_nearest(float v, float absmax) {
  if (absmax == 0.f) {
    return 7;
  }
  const float s = v / absmax;
  uint8_t best = 0;
  float best_diff = std::abs(s - kNF4[0]);
  for (uint8_t k = 1; k < 16; ++k) {
    const float diff = std::abs(s - kNF4[k]);
    if (diff < best_diff) {
      best_diff = diff;
      best = k;
    }
  }
  return best;
}

template <typename T>
void nf4_quantize_kernel(const T* x, int64_t blocks, int64_t block, uint8_t* packed, float* absmax) {
  at::parallel_for(0, blocks, row_grain(block), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const T* xb = x + b * block;
      float m = 0.f;
      for (int64_t i = 0; i < block; ++i) {
        m = std::max(m, std::abs(static_cast<float>(xb[i])));
      }
      absmax[b] = m;
      uint8_t* out = packed + b * block / 2;
      for (int64_t i = 0; i < block; i += 2) {
        const uint8_t hi = nf4_nearest(static_cast<float>(xb[i]), m);
        out[i / 2] = static_cast<uint8_t>((hi << 4) | nf4_nearest(static_cast<float>(xb[i + 1]), m));
      }
    }
  });
}

template <typename T>
void nf4_dequantize_kernel(
    const uint8_t* packed, const float* absmax, int64_t blocks, int64_t block, T* out) {
  at::parallel_for(0, blocks, row_grain(block), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float m = absmax[b];
      const uint8_t* in = packed + b * block / 2;
      T* ob = out + b * block;
      for (int64_t i = 0; i < block; i += 2) {
        ob[i] = static_cast<T>(kNF4[in[i / 2] >> 4] * m);
        ob[i + 1] = static_cast<T>(kNF4[in[i / 2] & 15] * m);
      }
    }
  });
}

// x: contiguous fp32/bf16 with numel a multiple of block (even) -> (packed uint8, absmax fp32).
std::vector<at::Tensor> nf4_quantize(const at::Tensor& x, int64_t block) {
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  TORCH_CHECK(block > 0 && block % 2 == 0, "block must be positive and even");
  TORCH_CHECK(x.numel() % block == 0, "block must divide the number of elements");
  const int64_t blocks = x.numel() / block;
  auto packed = at::empty({x.numel() / 2}, x.options().dtype(at::kByte));
  auto absmax = at::empty({blocks}, x.options().dtype(at::kFloat));
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    nf4_quantize_kernel<scalar_t>(
        x.data_ptr<scalar_t>(), blocks, block, packed.data_ptr<uint8_t>(), absmax.data_ptr<float>());
  });
  return {packed, absmax};
}

// The values of nf4_quantize's output, flat, in `dtype` (fp32 or bf16).
at::Tensor nf4_dequantize(
    const at::Tensor& packed, const at::Tensor& absmax, int64_t block, at::ScalarType dtype) {
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kByte, "packed: uint8");
  TORCH_CHECK(absmax.is_contiguous() && absmax.scalar_type() == at::kFloat, "absmax: fp32");
  TORCH_CHECK(block > 0 && block % 2 == 0, "block must be positive and even");
  TORCH_CHECK(packed.numel() * 2 == absmax.numel() * block, "packed and absmax sizes differ");
  auto out = at::empty({packed.numel() * 2}, packed.options().dtype(dtype));
  dispatch(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    nf4_dequantize_kernel<scalar_t>(
        packed.data_ptr<uint8_t>(), absmax.data_ptr<float>(), absmax.numel(), block,
        out.data_ptr<scalar_t>());
  });
  return out;
}


}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm_fwd", &rms_norm_fwd, "RMSNorm forward -> (y, rstd)");
  m.def("rms_norm_bwd", &rms_norm_bwd, "RMSNorm backward -> (dx[, dw])");
  m.def("swiglu_fwd", &swiglu_fwd, "silu(a) * b");
  m.def("swiglu_bwd", &swiglu_bwd, "SwiGLU backward into (da, db)");
  m.def("rotary", &rotary, "rotary embedding (inverse=True is the backward)");
  m.def("nf4_quantize", &nf4_quantize, "NF4 quantise -> (packed uint8, absmax fp32)");
  m.def("nf4_dequantize", &nf4_dequantize, "NF4 dequantise -> flat values");
  m.def("skinny_linear", &mindspeed_ops_cpu::skinny_linear, "x @ w^T (* scale), few rows");
  m.def("skinny_linear_simd", &mindspeed_ops_cpu::skinny_linear_simd, "AVX2 skinny_linear?");
  m.def("flash_attention_fwd", &mindspeed_ops_cpu::flash_attention_fwd,
        "packed flash attention -> (out, lse)");
  m.def("flash_attention_bwd", &mindspeed_ops_cpu::flash_attention_bwd,
        "packed flash attention backward from the lse -> (dq, dk, dv)");
}
