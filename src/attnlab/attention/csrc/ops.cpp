// The CPU kernels of attnlab's PyTorch operators (torch.ops.attnlab.decode, ...). fused.py defines the operators
// (their schemas, fake implementations and FLOP formulas, in one place); this unit registers their CPU
// implementations through LibTorch's stable ABI (torch/csrc/stable/), whose headers take under a second to
// compile where torch/library.h takes five (the first use builds this). Each implementation reads its arguments by
// their names (ARGS below, which fused.py checks against its schemas when it loads the library: the two cannot
// drift apart), checks them (a ValueError naming the argument and its value), fills the struct of kernels.h field
// by field and runs the kernel unit (kernels.cpp).
//
// ATTNLAB_OPS is the operators' namespace (fused.py passes it: "attnlab", or another for a second build loaded
// beside the first, as benchmarks/kernel_ab.py and the tests' AVX2 build do).

#include <c10/util/Exception.h>  // TORCH_CHECK_VALUE: a ValueError in Python
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kernels.h"

#ifndef ATTNLAB_OPS
#define ATTNLAB_OPS attnlab
#endif

namespace attnlab_fused {
namespace {

using torch::stable::Tensor;
using torch::stable::detail::from;
using torch::stable::detail::to;

// The arguments of each operator as the kernels below read them, in the order of the schemas of fused.py (checked
// there at load: ``signatures``).
constexpr std::string_view kDecode[] = {"q", "k", "v", "scale"};
constexpr std::string_view kMlaDecode[] = {"q", "rows", "value_dim", "scale"};
constexpr std::string_view kStaticDecode[] = {"q", "k", "v", "lengths", "window", "scale"};
constexpr std::string_view kPagedDecode[] = {"q", "k_pool", "v_pool", "table", "block", "first", "lengths", "scale"};
constexpr std::string_view kLinear[] = {"x", "weights", "biases"};
constexpr std::string_view kBlockStep[] = {
    "x",  "attn_norm", "wq", "wk", "wv", "bq", "bk", "bv",  "wo",      "bo",      "ffn_norm", "w1",
    "w3", "w2",        "b1", "b3", "b2", "cos", "sin", "cache_k", "cache_v", "pos", "eps",     "scale"};
constexpr std::string_view kAmx[] = {"on"};

// The place of `name` among an operator's arguments; ARG(names, name) looks it up while compiling (a misspelt name
// is not a constant: it does not build).
template <size_t N>
constexpr size_t at(const std::string_view (&names)[N], std::string_view name) {
  for (size_t i = 0; i < N; ++i)
    if (names[i] == name) return i;
  throw std::logic_error("no such argument");
}
#define ARG(names, name) std::integral_constant<size_t, at(names, name)>::value

DType dtype_of(const Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.is_cpu(), "attnlab: ", name, " must be a CPU tensor");
  if (t.scalar_type() == torch::headeronly::ScalarType::Float) return DType::float32;
  TORCH_CHECK_VALUE(t.scalar_type() == torch::headeronly::ScalarType::BFloat16, "attnlab: ", name,
                    " must be float32 or bfloat16, got ", t.scalar_type());
  return DType::bfloat16;
}

// `t` of `like`'s dtype on the CPU, as a pointer the kernels read.
const void* operand(const Tensor& t, const Tensor& like, const char* name) {
  TORCH_CHECK_VALUE(t.is_cpu() && t.scalar_type() == like.scalar_type(), "attnlab: ", name, " is ", t.scalar_type(),
                    ", expected ", like.scalar_type(), " on the CPU");
  return t.const_data_ptr();
}

// `t`, or a contiguous copy if it is not (asked first: torch::stable::contiguous is a dispatcher call even when it
// has nothing to copy).
Tensor dense(Tensor t) { return t.is_contiguous() ? t : torch::stable::contiguous(t); }

// `t` if its rows (the last dim) are contiguous, as every cache's are; else a contiguous copy.
Tensor rows(Tensor t) { return t.stride(-1) == 1 || t.size(-1) <= 1 ? t : torch::stable::contiguous(t); }

// A new contiguous CPU tensor of `like`'s dtype: straight through the C shim (torch::stable::new_empty finds
// aten::new_empty by name and calls it boxed, ~1 us more per call).
Tensor empty(const Tensor& like, const std::vector<int64_t>& sizes) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (size_t i = sizes.size(); i-- > 1;) strides[i - 1] = strides[i] * sizes[i];
  int32_t dtype;
  AtenTensorHandle out;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(like.get(), &dtype));
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), sizes.data(),
                                                         strides.data(), dtype, aoti_torch_device_type_cpu(), 0,
                                                         &out));
  return Tensor(out);
}

Strides strides(const Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

void check_rc(int rc, const char* op) {
  TORCH_CHECK_VALUE(rc == 0, "attnlab: ", op, ": the kernel rejected its arguments (code ", rc, ")");
}

// For messages: "(2, 8, 1, 64)".
std::string shape(const Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); ++i) (s += i ? ", " : "") += std::to_string(t.size(i));
  return s + ")";
}

bool has_shape(const Tensor& t, std::initializer_list<int64_t> want) {
  return t.dim() == static_cast<int64_t>(want.size()) && std::equal(want.begin(), want.end(), t.sizes().begin());
}

// q (B, H, 1, dk): one query per head.
void check_queries(const Tensor& q) {
  TORCH_CHECK_VALUE(q.dim() == 4 && q.size(2) == 1, "attnlab: q must be (B, H, 1, Dk), got ", shape(q));
  // no heads or no dims: the kernels divide by both (a zero here killed the process with SIGFPE)
  TORCH_CHECK_VALUE(q.size(1) > 0 && q.size(3) > 0, "attnlab: q needs H >= 1 heads of Dk >= 1 dims, got ", shape(q));
}

// k (B, n_kv, S, dk) and v (B, n_kv, S, dv <= dk) for q (B, H, 1, dk), H a multiple of n_kv.
void check_cache(const Tensor& q, const Tensor& k, const Tensor& v) {
  TORCH_CHECK_VALUE(k.dim() == 4 && v.dim() == 4 && k.size(0) == q.size(0) && v.size(0) == q.size(0) &&
                        k.size(1) == v.size(1) && k.size(1) > 0 && q.size(1) % k.size(1) == 0 &&
                        k.size(3) == q.size(3) && v.size(2) == k.size(2) && v.size(3) <= k.size(3),
                    "attnlab: inconsistent shapes q ", shape(q), ", k ", shape(k), ", v ", shape(v));
}

// Attention of q (B, H, 1, dk) over the cache that `cache` describes (keys, values, their strides, table and each
// row's bounds, set by the caller): the query's and the output's fields are filled here.
Tensor run_decode(const Tensor& q, DecodeArgs cache, double scale, const char* op) {
  Tensor out = empty(q, {q.size(0), q.size(1), 1, cache.dv});
  cache.dtype = dtype_of(q, "q");
  cache.q = q.const_data_ptr();
  cache.B = q.size(0);
  cache.H = q.size(1);
  cache.dk = q.size(3);
  cache.scale = static_cast<float>(scale);
  cache.out = out.mutable_data_ptr();
  cache.threads = static_cast<int>(torch::stable::get_num_threads());
  check_rc(kernels::decode(cache), op);
  return out;
}

// Attention over contiguous rows lo[b] .. hi[b]-1 of batch row b; the values are `v`, or the first `dv` columns of
// the key rows (MLA) when v is k.
Tensor attend(const Tensor& q_in, const Tensor& k, const Tensor& v, int64_t dv, double scale, const char* op,
              const std::vector<int64_t>& lo, const std::vector<int64_t>& hi) {
  const Tensor q = dense(q_in);
  return run_decode(q,
                    {.n_kv = k.size(1),
                     .dv = dv,
                     .k = operand(k, q, "k"),
                     .k_strides = strides(k),
                     .v = operand(v, q, "v"),
                     .v_strides = strides(v),
                     .lo = lo.data(),
                     .hi = hi.data()},
                    scale, op);
}

// ... over rows 0 .. S-1 of every batch row.
Tensor attend(const Tensor& q, const Tensor& k, const Tensor& v, int64_t dv, double scale, const char* op) {
  const std::vector<int64_t> lo(q.size(0), 0), hi(q.size(0), k.size(2));
  return attend(q, k, v, dv, scale, op, lo, hi);
}

// decode(Tensor q, Tensor k, Tensor v, float scale) -> Tensor
void decode(StableIValue* stack, uint64_t, uint64_t) {
  constexpr auto& n = kDecode;
  const Tensor q = to<Tensor>(stack[ARG(n, "q")]);
  const Tensor k = rows(to<Tensor>(stack[ARG(n, "k")])), v = rows(to<Tensor>(stack[ARG(n, "v")]));
  const double scale = to<double>(stack[ARG(n, "scale")]);
  check_queries(q);
  check_cache(q, k, v);
  stack[0] = from(attend(q, k, v, v.size(3), scale, "decode"));
}

// mla_decode(Tensor q, Tensor rows, int value_dim, float scale) -> Tensor
void mla_decode(StableIValue* stack, uint64_t, uint64_t) {
  constexpr auto& n = kMlaDecode;
  const Tensor q = to<Tensor>(stack[ARG(n, "q")]);
  const Tensor k = rows(to<Tensor>(stack[ARG(n, "rows")]));
  const int64_t dv = to<int64_t>(stack[ARG(n, "value_dim")]);
  const double scale = to<double>(stack[ARG(n, "scale")]);
  check_queries(q);
  check_cache(q, k, k);
  TORCH_CHECK_VALUE(0 < dv && dv <= k.size(3), "attnlab: value_dim must be in 1 .. ", k.size(3), ", got ", dv);
  stack[0] = from(attend(q, k, k, dv, scale, "mla_decode"));
}

// static_decode(Tensor q, Tensor k, Tensor v, Tensor lengths, int window, float scale) -> Tensor: k, v fixed
// buffers (B, n_kv, S, d) of which row b holds its first lengths[b] tokens (an int64 tensor, read here: on a CPU
// that costs no sync, and a compiled step keeps it a tensor); window > 0: each row's last `window` of them.
void static_decode(StableIValue* stack, uint64_t, uint64_t) {
  constexpr auto& n = kStaticDecode;
  const Tensor q = dense(to<Tensor>(stack[ARG(n, "q")]));
  const Tensor k = rows(to<Tensor>(stack[ARG(n, "k")])), v = rows(to<Tensor>(stack[ARG(n, "v")]));
  const Tensor lengths = dense(to<Tensor>(stack[ARG(n, "lengths")]));
  const int64_t window = to<int64_t>(stack[ARG(n, "window")]);
  const double scale = to<double>(stack[ARG(n, "scale")]);
  check_queries(q);
  check_cache(q, k, v);
  const int64_t B = q.size(0), S = k.size(2);
  TORCH_CHECK_VALUE(lengths.is_cpu() && lengths.scalar_type() == torch::headeronly::ScalarType::Long &&
                        has_shape(lengths, {B}),
                    "attnlab: static_decode lengths must be an int64 CPU tensor of shape (", B, "), got ",
                    lengths.scalar_type(), " ", shape(lengths));
  TORCH_CHECK_VALUE(window >= 0, "attnlab: static_decode window must be >= 0 (0: none), got ", window);
  const auto* len = static_cast<const int64_t*>(lengths.const_data_ptr());
  std::vector<int64_t> lo(B), hi(len, len + B);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(0 <= hi[b] && hi[b] <= S, "attnlab: static_decode row ", b, " has length ", hi[b],
                      ", outside 0 .. ", S);
    lo[b] = window > 0 ? std::max<int64_t>(0, hi[b] - window) : 0;
  }
  stack[0] = from(attend(q, k, v, v.size(3), scale, "static_decode", lo, hi));
}

// paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, int[] table, int block, int[] first, int[] lengths,
//              float scale) -> Tensor
void paged_decode(StableIValue* stack, uint64_t, uint64_t) {
  constexpr auto& n = kPagedDecode;
  const Tensor q = dense(to<Tensor>(stack[ARG(n, "q")]));
  const Tensor k = rows(to<Tensor>(stack[ARG(n, "k_pool")])), v = rows(to<Tensor>(stack[ARG(n, "v_pool")]));
  const auto table = to<std::vector<int64_t>>(stack[ARG(n, "table")]);
  const auto first = to<std::vector<int64_t>>(stack[ARG(n, "first")]);
  const auto lengths = to<std::vector<int64_t>>(stack[ARG(n, "lengths")]);
  const int64_t block = to<int64_t>(stack[ARG(n, "block")]);
  const double scale = to<double>(stack[ARG(n, "scale")]);
  check_queries(q);
  const int64_t B = q.size(0), H = q.size(1);
  TORCH_CHECK_VALUE(k.dim() == 3 && v.dim() == 3 && k.size(0) == v.size(0) && k.size(0) > 0 &&
                        H % k.size(0) == 0 && k.size(2) == q.size(3) && v.size(1) == k.size(1) &&
                        v.size(2) <= k.size(2),
                    "attnlab: inconsistent shapes q ", shape(q), ", k_pool ", shape(k), ", v_pool ", shape(v));
  TORCH_CHECK_VALUE(B > 0, "attnlab: paged_decode needs B >= 1 rows, got q ", shape(q));
  TORCH_CHECK_VALUE(block > 0 && static_cast<int64_t>(first.size()) == B &&
                        static_cast<int64_t>(lengths.size()) == B && B > 0 &&
                        static_cast<int64_t>(table.size()) % B == 0,
                    "attnlab: paged_decode needs ", B, " first and lengths entries and a table of whole rows, got ",
                    first.size(), ", ", lengths.size(), " and ", table.size(), " with block ", block);
  const int64_t width = static_cast<int64_t>(table.size()) / B, slots = k.size(1);
  for (int64_t b = 0; b < B; ++b) {
    // pages counted by division, slots compared by subtraction: no product or sum of table entries may overflow
    const int64_t pages = lengths[b] / block + (lengths[b] % block != 0);
    TORCH_CHECK_VALUE(0 <= first[b] && first[b] <= lengths[b] && pages <= width, "attnlab: row ", b,
                      " attends to tokens ", first[b], " .. ", lengths[b], " of ", width, " pages of ", block,
                      " in its table");
    for (int64_t j = 0; j < pages; ++j) {  // the pages the row reads, its last one in part
      const int64_t slot = table[b * width + j], used = std::min(block, lengths[b] - j * block);
      TORCH_CHECK_VALUE(0 <= slot && slot <= slots - used, "attnlab: row ", b, "'s table slot ", slot, " (", used,
                        " tokens) outside the pool of ", slots);
    }
  }
  stack[0] = from(run_decode(q,
                             {.n_kv = k.size(0),
                              .dv = v.size(2),
                              .k = operand(k, q, "k_pool"),
                              .k_strides = {0, k.stride(0), k.stride(1)},
                              .v = operand(v, q, "v_pool"),
                              .v_strides = {0, v.stride(0), v.stride(1)},
                              .table = table.data(),
                              .table_stride = width,
                              .block = block,
                              .lo = first.data(),
                              .hi = lengths.data()},
                             scale, "paged_decode"));
}

// linear(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor
void linear(StableIValue* stack, uint64_t, uint64_t) {
  constexpr auto& n = kLinear;
  const Tensor x_in = to<Tensor>(stack[ARG(n, "x")]);
  auto weights = to<std::vector<Tensor>>(stack[ARG(n, "weights")]);
  auto biases = to<std::vector<std::optional<Tensor>>>(stack[ARG(n, "biases")]);
  TORCH_CHECK_VALUE(x_in.dim() >= 1 && !weights.empty() && biases.size() == weights.size(),
                    "attnlab: linear needs an input (..., K) and as many biases (or None) as weights, got x ",
                    shape(x_in), ", ", weights.size(), " weights, ", biases.size(), " biases");
  const int64_t K = x_in.size(-1);
  // F.linear gives the bias there; the kernel would write nothing and leave y's memory as it was
  TORCH_CHECK_VALUE(K > 0, "attnlab: linear needs K >= 1 input features, got x ", shape(x_in));
  const Tensor x = dense(x_in);  // (..., K), its rows back to back: (M, K) to the kernel
  const int64_t M = x.numel() / K;
  std::vector<const void*> ws, bs;
  std::vector<int64_t> ns;
  for (size_t i = 0; i < weights.size(); ++i) {
    Tensor& w = weights[i];
    w = dense(w);
    TORCH_CHECK_VALUE(w.dim() == 2 && w.size(1) == K, "attnlab: linear weight ", i, " is ", shape(w),
                      ", expected (N, ", K, ")");
    ws.push_back(operand(w, x, "weight"));
    ns.push_back(w.size(0));
    std::optional<Tensor>& b = biases[i];
    if (b.has_value()) b = dense(*b);
    TORCH_CHECK_VALUE(!b.has_value() || (b->dim() == 1 && b->size(0) == w.size(0)), "attnlab: linear bias ", i,
                      " must be None or (", w.size(0), ")");
    bs.push_back(b.has_value() ? operand(*b, x, "bias") : nullptr);
  }
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = 0;
  for (const int64_t rows_n : ns) out_shape.back() += rows_n;
  Tensor y = empty(x, out_shape);
  const LinearArgs args{.dtype = dtype_of(x, "x"),
                        .x = x.const_data_ptr(),
                        .M = M,
                        .K = K,
                        .n_w = static_cast<int64_t>(ws.size()),
                        .weights = ws.data(),
                        .ns = ns.data(),
                        .biases = bs.data(),
                        .y = y.mutable_data_ptr(),
                        .threads = static_cast<int>(torch::stable::get_num_threads())};
  check_rc(kernels::linear(args), "linear");
  stack[0] = from(y);
}

// block_step(Tensor x, <the fields of fused.BlockWeights>, Tensor? cos, Tensor? sin, Tensor(a!) cache_k,
//            Tensor(b!) cache_v, int pos, float eps, float scale) -> Tensor
void block_step(StableIValue* stack, uint64_t, uint64_t) {
  constexpr auto& n = kBlockStep;
  auto tensor = [&](size_t i) { return to<Tensor>(stack[i]); };
  auto optional = [&](size_t i) { return to<std::optional<Tensor>>(stack[i]); };
  const Tensor x = tensor(ARG(n, "x")), attn_norm = tensor(ARG(n, "attn_norm")), wq = tensor(ARG(n, "wq")),
               wk = tensor(ARG(n, "wk")), wv = tensor(ARG(n, "wv")), wo = tensor(ARG(n, "wo")),
               ffn_norm = tensor(ARG(n, "ffn_norm")), w1 = tensor(ARG(n, "w1")), w3 = tensor(ARG(n, "w3")),
               w2 = tensor(ARG(n, "w2")), cache_k = tensor(ARG(n, "cache_k")), cache_v = tensor(ARG(n, "cache_v"));
  const std::optional<Tensor> bq = optional(ARG(n, "bq")), bk = optional(ARG(n, "bk")), bv = optional(ARG(n, "bv")),
                              bo = optional(ARG(n, "bo")), b1 = optional(ARG(n, "b1")), b3 = optional(ARG(n, "b3")),
                              b2 = optional(ARG(n, "b2")), cos = optional(ARG(n, "cos")), sin = optional(ARG(n, "sin"));
  const int64_t pos = to<int64_t>(stack[ARG(n, "pos")]);
  const double eps = to<double>(stack[ARG(n, "eps")]), scale = to<double>(stack[ARG(n, "scale")]);
  TORCH_CHECK_VALUE(x.dim() == 3 && x.size(1) == 1 && x.size(0) > 0 && x.is_contiguous(),
                    "attnlab: block_step's x must be contiguous (B, 1, D), got ", shape(x));
  const int64_t M = x.size(0), D = x.size(2), hd = cache_k.dim() == 4 ? cache_k.size(3) : 0;
  TORCH_CHECK_VALUE(hd > 0 && hd % 2 == 0 && wq.dim() == 2 && wk.dim() == 2 && wq.size(0) > 0 &&
                        wq.size(0) % hd == 0 && wk.size(0) % hd == 0 && wk.size(0) > 0 &&
                        (wq.size(0) / hd) % (wk.size(0) / hd) == 0,
                    "attnlab: block_step: wq ", shape(wq), " and wk ", shape(wk), " are not heads of the cache's ",
                    hd, " dims (an even number)");
  const int64_t H = wq.size(0) / hd, n_kv = wk.size(0) / hd, F = w1.dim() == 2 ? w1.size(0) : 0;
  const int64_t qw = H * hd, kw = n_kv * hd;
  // every weight and bias: contiguous, of x's dtype, of the block's shape
  auto weight = [&](const Tensor& t, const char* name, std::initializer_list<int64_t> want) -> const void* {
    TORCH_CHECK_VALUE(has_shape(t, want) && t.is_contiguous(), "attnlab: block_step's ", name, " is ", shape(t),
                      ", expected contiguous of ", want.size(), " dims (", *want.begin(), ", ...)");
    return operand(t, x, name);
  };
  auto bias = [&](const std::optional<Tensor>& t, const char* name, int64_t size) -> const void* {
    return t.has_value() ? weight(*t, name, {size}) : nullptr;
  };
  TORCH_CHECK_VALUE(cache_k.dim() == 4 && cache_k.size(0) == M && cache_k.size(1) == n_kv &&
                        has_shape(cache_v, {M, n_kv, cache_k.size(2), hd}) && cache_k.stride(-1) == 1 && cache_v.stride(-1) == 1 &&
                        0 <= pos && pos < cache_k.size(2),
                    "attnlab: block_step: cache ", shape(cache_k), " / ", shape(cache_v), " at position ", pos,
                    " for x ", shape(x), " and ", n_kv, " KV heads of dim ", hd);
  int64_t rope_stride = 0;
  if (cos.has_value()) {
    TORCH_CHECK_VALUE(sin.has_value() && cos->scalar_type() == torch::headeronly::ScalarType::Float &&
                          sin->scalar_type() == torch::headeronly::ScalarType::Float && cos->is_contiguous() &&
                          sin->is_contiguous() && cos->numel() == sin->numel() && cos->size(-1) == hd &&
                          (cos->numel() == hd || cos->numel() == M * hd),
                      "attnlab: block_step's cos/sin must be contiguous float32 of ", hd, " values (1 or ", M,
                      " rows), got ", shape(*cos));
    rope_stride = cos->numel() == hd ? 0 : hd;
  }
  Tensor out = empty(x, {x.size(0), x.size(1), x.size(2)});
  const BlockArgs args{.dtype = dtype_of(x, "x"),
                       .M = M,
                       .D = D,
                       .H = H,
                       .n_kv = n_kv,
                       .hd = hd,
                       .F = F,
                       .pos = pos,
                       .k_strides = strides(cache_k),
                       .v_strides = strides(cache_v),
                       .rope_stride = rope_stride,
                       .eps = static_cast<float>(eps),
                       .scale = static_cast<float>(scale),
                       .x = x.const_data_ptr(),
                       .attn_norm = weight(attn_norm, "attn_norm", {D}),
                       .wq = weight(wq, "wq", {qw, D}),
                       .wk = weight(wk, "wk", {kw, D}),
                       .wv = weight(wv, "wv", {kw, D}),
                       .bq = bias(bq, "bq", qw),
                       .bk = bias(bk, "bk", kw),
                       .bv = bias(bv, "bv", kw),
                       .wo = weight(wo, "wo", {D, qw}),
                       .bo = bias(bo, "bo", D),
                       .ffn_norm = weight(ffn_norm, "ffn_norm", {D}),
                       .w1 = weight(w1, "w1", {F, D}),
                       .w3 = weight(w3, "w3", {F, D}),
                       .w2 = weight(w2, "w2", {D, F}),
                       .b1 = bias(b1, "b1", F),
                       .b3 = bias(b3, "b3", F),
                       .b2 = bias(b2, "b2", D),
                       .cos = cos.has_value() ? cos->const_data_ptr<float>() : nullptr,
                       .sin = cos.has_value() ? sin->const_data_ptr<float>() : nullptr,
                       .cache_k = const_cast<void*>(operand(cache_k, x, "cache_k")),
                       .cache_v = const_cast<void*>(operand(cache_v, x, "cache_v")),
                       .out = out.mutable_data_ptr(),
                       .threads = static_cast<int>(torch::stable::get_num_threads())};
  check_rc(kernels::block_step(args), "block_step");
  stack[0] = from(out);
}

// amx(int on) -> int: on 0 or 1 turns the pair path (AMX tiles or AVX512-BF16 dot products) off or on, -1 leaves
// it; the features after (kernels.h).
void amx(StableIValue* stack, uint64_t, uint64_t) {
  const int64_t on = to<int64_t>(stack[ARG(kAmx, "on")]);
  stack[0] = from(static_cast<int64_t>(on < 0 ? kernels::features() : kernels::set_amx(on != 0)));
}

// signatures() -> str[]: each operator's arguments as the kernels above read them, "decode(q, k, v, scale)", ...
template <size_t N>
std::string signature(std::string_view op, const std::string_view (&names)[N]) {
  std::string s(op);
  for (size_t i = 0; i < N; ++i) (s += i ? ", " : "(") += names[i];
  return s + ")";
}

void signatures(StableIValue* stack, uint64_t, uint64_t) {
  stack[0] = from(std::vector<std::string>{
      signature("decode", kDecode), signature("mla_decode", kMlaDecode),
      signature("static_decode", kStaticDecode), signature("paged_decode", kPagedDecode),
      signature("linear", kLinear), signature("block_step", kBlockStep), signature("amx", kAmx)});
}

}  // namespace
}  // namespace attnlab_fused

// STABLE_TORCH_LIBRARY_IMPL pastes its namespace argument into names, so ATTNLAB_OPS is expanded through this
// macro first.
#define ATTNLAB_IMPL(ns, key, m) STABLE_TORCH_LIBRARY_IMPL(ns, key, m)

ATTNLAB_IMPL(ATTNLAB_OPS, CPU, m) {
  namespace f = attnlab_fused;
  m.impl("decode", &f::decode);
  m.impl("mla_decode", &f::mla_decode);
  m.impl("static_decode", &f::static_decode);
  m.impl("paged_decode", &f::paged_decode);
  m.impl("linear", &f::linear);
  m.impl("block_step", &f::block_step);
}

// amx and signatures take no tensor, so no device picks their kernels: registered for every key.
ATTNLAB_IMPL(ATTNLAB_OPS, CompositeExplicitAutograd, m) {
  m.impl("amx", &attnlab_fused::amx);
  m.impl("signatures", &attnlab_fused::signatures);
}
