// The CPU kernels of attnlab's PyTorch operators (torch.ops.attnlab.decode, ...). fused.py defines the operators
// (their schemas, fake implementations and FLOP formulas, in one place); this unit, the only one that includes
// PyTorch headers, registers their CPU implementations. Each implementation reads its arguments by their names in
// the schema (never by position), checks them (a ValueError naming the argument and its value), fills the struct of
// kernels.h field by field and runs the kernel unit (kernels.cpp).
//
// ATTNLAB_OPS is the operators' namespace (fused.py passes it: "attnlab", or another for a second build loaded
// beside the first, as benchmarks/kernel_ab.py and the tests' AVX2 build do).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string_view>
#include <vector>

#include "kernels.h"

#ifndef ATTNLAB_OPS
#define ATTNLAB_OPS attnlab
#endif

namespace attnlab_fused {
namespace {

using at::Tensor;

// One call's arguments, by their names in the operator's schema; the result replaces them on the stack.
class Args {
 public:
  Args(const c10::OperatorHandle& op, torch::jit::Stack* stack)
      : schema_(op.schema()), stack_(stack), first_(stack->size() - schema_.arguments().size()) {}

  const c10::IValue& operator[](std::string_view name) const {
    // from where the last name was found: the kernels ask mostly in the schema's order, so one or two compares
    const auto& args = schema_.arguments();
    for (size_t k = 0; k < args.size(); ++k) {
      const size_t i = (next_ + k) % args.size();
      if (args[i].name() == name) {
        next_ = i + 1;
        return (*stack_)[first_ + i];
      }
    }
    TORCH_CHECK(false, schema_.name(), " has no argument ", name);
    return (*stack_)[first_];  // not reached
  }
  const Tensor& tensor(std::string_view name) const { return (*this)[name].toTensor(); }
  // nullptr for None
  const Tensor* optional(std::string_view name) const {
    const c10::IValue& v = (*this)[name];
    return v.isNone() ? nullptr : &v.toTensor();
  }
  void result(c10::IValue out) {
    torch::jit::drop(*stack_, schema_.arguments().size());
    torch::jit::push(*stack_, std::move(out));
  }

 private:
  const c10::FunctionSchema& schema_;
  torch::jit::Stack* stack_;
  size_t first_;
  mutable size_t next_ = 0;
};

DType dtype_of(const Tensor& t, std::string_view name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "attnlab: ", name, " must be a CPU tensor, got ", t.device());
  if (t.scalar_type() == at::kFloat) return DType::float32;
  TORCH_CHECK_VALUE(t.scalar_type() == at::kBFloat16, "attnlab: ", name, " must be float32 or bfloat16, got ",
                    t.scalar_type());
  return DType::bfloat16;
}

// `t` of `q`'s dtype, as a pointer the kernels read.
const void* operand(const Tensor& t, const Tensor& q, std::string_view name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == q.scalar_type(), "attnlab: ", name, " is ",
                    t.scalar_type(), " on ", t.device(), ", expected ", q.scalar_type(), " on the CPU");
  return t.const_data_ptr();
}

// `t` if its rows (the last dim) are contiguous, as every cache's are; else a contiguous copy.
Tensor rows(const Tensor& t) { return t.stride(-1) == 1 || t.size(-1) <= 1 ? t : t.contiguous(); }

Strides strides(const Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

void check_rc(int rc, std::string_view op) {
  TORCH_CHECK_VALUE(rc == 0, "attnlab: ", op, ": the kernel rejected its arguments (code ", rc, ")");
}

// q (B, H, 1, dk): one query per head.
void check_queries(const Tensor& q) {
  TORCH_CHECK_VALUE(q.dim() == 4 && q.size(2) == 1, "attnlab: q must be (B, H, 1, Dk), got ", q.sizes());
}

// k (B, n_kv, S, dk) and v (B, n_kv, S, dv <= dk) for q (B, H, 1, dk), H a multiple of n_kv.
void check_cache(const Tensor& q, const Tensor& k, const Tensor& v) {
  TORCH_CHECK_VALUE(k.dim() == 4 && v.dim() == 4 && k.size(0) == q.size(0) && v.size(0) == q.size(0) &&
                        k.size(1) == v.size(1) && k.size(1) > 0 && q.size(1) % k.size(1) == 0 &&
                        k.size(3) == q.size(3) && v.size(2) == k.size(2) && v.size(3) <= k.size(3),
                    "attnlab: inconsistent shapes q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
}

// Attention of q (B, H, 1, dk) over the cache that `cache` describes (keys, values, their strides, table and each
// row's bounds, set by the caller): the query's and the output's fields are filled here.
Tensor run_decode(const Tensor& q, DecodeArgs cache, double scale, std::string_view op) {
  Tensor out = at::empty({q.size(0), q.size(1), 1, cache.dv}, q.options());
  cache.dtype = dtype_of(q, "q");
  cache.q = q.const_data_ptr();
  cache.B = q.size(0);
  cache.H = q.size(1);
  cache.dk = q.size(3);
  cache.scale = static_cast<float>(scale);
  cache.out = out.mutable_data_ptr();
  cache.threads = at::get_num_threads();
  check_rc(kernels::decode(cache), op);
  return out;
}

// Attention over contiguous rows 0 .. S-1 of every batch row; the values are `v`, or the first `dv` columns of
// the key rows (MLA) when v is k.
Tensor attend(const Tensor& q_in, const Tensor& k, const Tensor& v, int64_t dv, double scale, std::string_view op) {
  const Tensor q = q_in.contiguous();
  const std::vector<int64_t> lo(q.size(0), 0), hi(q.size(0), k.size(2));
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

// decode(Tensor q, Tensor k, Tensor v, float scale) -> Tensor
void decode(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  Args a(op, stack);
  const Tensor& q = a.tensor("q");
  const Tensor k = rows(a.tensor("k")), v = rows(a.tensor("v"));
  check_queries(q);
  check_cache(q, k, v);
  a.result(attend(q, k, v, v.size(3), a["scale"].toDouble(), "decode"));
}

// mla_decode(Tensor q, Tensor rows, int value_dim, float scale) -> Tensor
void mla_decode(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  Args a(op, stack);
  const Tensor& q = a.tensor("q");
  const Tensor k = rows(a.tensor("rows"));
  const int64_t dv = a["value_dim"].toInt();
  check_queries(q);
  check_cache(q, k, k);
  TORCH_CHECK_VALUE(0 < dv && dv <= k.size(3), "attnlab: value_dim must be in 1 .. ", k.size(3), ", got ", dv);
  a.result(attend(q, k, k, dv, a["scale"].toDouble(), "mla_decode"));
}

// paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, int[] table, int block, int[] first, int[] lengths,
//              float scale) -> Tensor
void paged_decode(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  Args a(op, stack);
  const Tensor q = a.tensor("q").contiguous();
  const Tensor k = rows(a.tensor("k_pool")), v = rows(a.tensor("v_pool"));
  const auto table = a["table"].toIntVector(), first = a["first"].toIntVector(), lengths = a["lengths"].toIntVector();
  const int64_t block = a["block"].toInt();
  check_queries(q);
  const int64_t B = q.size(0), H = q.size(1);
  TORCH_CHECK_VALUE(k.dim() == 3 && v.dim() == 3 && k.size(0) == v.size(0) && k.size(0) > 0 &&
                        H % k.size(0) == 0 && k.size(2) == q.size(3) && v.size(1) == k.size(1) &&
                        v.size(2) <= k.size(2),
                    "attnlab: inconsistent shapes q ", q.sizes(), ", k_pool ", k.sizes(), ", v_pool ", v.sizes());
  TORCH_CHECK_VALUE(block > 0 && static_cast<int64_t>(first.size()) == B &&
                        static_cast<int64_t>(lengths.size()) == B && B > 0 &&
                        static_cast<int64_t>(table.size()) % B == 0,
                    "attnlab: paged_decode needs ", B, " first and lengths entries and a table of whole rows, got ",
                    first.size(), ", ", lengths.size(), " and ", table.size(), " with block ", block);
  const int64_t width = static_cast<int64_t>(table.size()) / B, slots = k.size(1);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(0 <= first[b] && first[b] <= lengths[b] && lengths[b] <= width * block, "attnlab: row ", b,
                      " attends to tokens ", first[b], " .. ", lengths[b], " of ", width * block, " in its table");
    for (int64_t j = 0; j * block < lengths[b]; ++j) {  // the pages the row reads, its last one in part
      const int64_t slot = table[b * width + j], used = std::min(block, lengths[b] - j * block);
      TORCH_CHECK_VALUE(0 <= slot && slot + used <= slots, "attnlab: row ", b, "'s table slot ", slot, " (", used,
                        " tokens) outside the pool of ", slots);
    }
  }
  a.result(run_decode(q,
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
                      a["scale"].toDouble(), "paged_decode"));
}

// linear(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor
void linear(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  Args a(op, stack);
  const Tensor& x_in = a.tensor("x");
  const auto weights = a["weights"].toTensorVector();
  const auto biases = a["biases"].toListRef();
  TORCH_CHECK_VALUE(x_in.dim() >= 1 && !weights.empty() && biases.size() == weights.size(),
                    "attnlab: linear needs an input (..., K) and as many biases (or None) as weights, got x ",
                    x_in.sizes(), ", ", weights.size(), " weights, ", biases.size(), " biases");
  const int64_t K = x_in.size(-1);
  const Tensor x = x_in.reshape({-1, K}).contiguous();
  std::vector<Tensor> held;  // contiguous copies of operands that were not (none, as parameters are)
  std::vector<const void*> ws, bs;
  std::vector<int64_t> ns;
  auto contiguous = [&](const Tensor& t) -> const Tensor& {
    if (t.is_contiguous()) return t;
    held.push_back(t.contiguous());
    return held.back();
  };
  held.reserve(2 * weights.size());
  for (size_t i = 0; i < weights.size(); ++i) {
    const Tensor& w = contiguous(weights[i]);
    TORCH_CHECK_VALUE(w.dim() == 2 && w.size(1) == K, "attnlab: linear weight ", i, " is ", w.sizes(),
                      ", expected (N, ", K, ")");
    ws.push_back(operand(w, x, "weight"));
    ns.push_back(w.size(0));
    const c10::IValue& b = biases[i];
    TORCH_CHECK_VALUE(b.isNone() || (b.toTensor().dim() == 1 && b.toTensor().size(0) == w.size(0)),
                      "attnlab: linear bias ", i, " must be None or (", w.size(0), ")");
    bs.push_back(b.isNone() ? nullptr : operand(contiguous(b.toTensor()), x, "bias"));
  }
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = 0;
  for (const int64_t n : ns) shape.back() += n;
  Tensor y = at::empty(shape, x.options());
  const LinearArgs args{.dtype = dtype_of(x, "x"),
                        .x = x.const_data_ptr(),
                        .M = x.size(0),
                        .K = K,
                        .n_w = static_cast<int64_t>(ws.size()),
                        .weights = ws.data(),
                        .ns = ns.data(),
                        .biases = bs.data(),
                        .y = y.mutable_data_ptr(),
                        .threads = at::get_num_threads()};
  check_rc(kernels::linear(args), "linear");
  a.result(y);
}

// block_step(Tensor x, <the fields of fused.BlockWeights>, Tensor? cos, Tensor? sin, Tensor(a!) cache_k,
//            Tensor(b!) cache_v, int pos, float eps, float scale) -> Tensor
void block_step(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  Args a(op, stack);
  const Tensor& x = a.tensor("x");
  const Tensor &wq = a.tensor("wq"), &wk = a.tensor("wk"), &w1 = a.tensor("w1");
  const Tensor &cache_k = a.tensor("cache_k"), &cache_v = a.tensor("cache_v");
  const int64_t pos = a["pos"].toInt();
  TORCH_CHECK_VALUE(x.dim() == 3 && x.size(1) == 1 && x.size(0) > 0 && x.is_contiguous(),
                    "attnlab: block_step's x must be contiguous (B, 1, D), got ", x.sizes());
  const int64_t M = x.size(0), D = x.size(2), hd = cache_k.dim() == 4 ? cache_k.size(3) : 0;
  TORCH_CHECK_VALUE(hd > 0 && hd % 2 == 0 && wq.dim() == 2 && wk.dim() == 2 && wq.size(0) % hd == 0 &&
                        wk.size(0) % hd == 0 && wk.size(0) > 0 && (wq.size(0) / hd) % (wk.size(0) / hd) == 0,
                    "attnlab: block_step: wq ", wq.sizes(), " and wk ", wk.sizes(), " are not heads of the cache's ",
                    hd, " dims (an even number)");
  const int64_t H = wq.size(0) / hd, n_kv = wk.size(0) / hd, F = w1.dim() == 2 ? w1.size(0) : 0;
  // every weight and bias: contiguous, of x's dtype, of the block's shape
  auto weight = [&](std::string_view name, std::initializer_list<int64_t> shape, bool optional) -> const void* {
    const Tensor* t = optional ? a.optional(name) : &a.tensor(name);
    if (t == nullptr) return nullptr;
    TORCH_CHECK_VALUE(t->sizes() == at::IntArrayRef(shape) && t->is_contiguous(), "attnlab: block_step's ", name,
                      " is ", t->sizes(), ", expected contiguous ", at::IntArrayRef(shape));
    return operand(*t, x, name);
  };
  TORCH_CHECK_VALUE(cache_k.sizes() == at::IntArrayRef({M, n_kv, cache_k.size(2), hd}) &&
                        cache_v.sizes() == cache_k.sizes() && cache_k.stride(-1) == 1 && cache_v.stride(-1) == 1 &&
                        0 <= pos && pos < cache_k.size(2),
                    "attnlab: block_step: cache ", cache_k.sizes(), " / ", cache_v.sizes(), " at position ", pos,
                    " for x ", x.sizes(), " and ", n_kv, " KV heads of dim ", hd);
  const Tensor *cos = a.optional("cos"), *sin = a.optional("sin");
  int64_t rope_stride = 0;
  if (cos != nullptr) {
    TORCH_CHECK_VALUE(sin != nullptr && cos->scalar_type() == at::kFloat && sin->scalar_type() == at::kFloat &&
                          cos->is_contiguous() && sin->is_contiguous() && cos->sizes() == sin->sizes() &&
                          cos->size(-1) == hd && (cos->numel() == hd || cos->numel() == M * hd),
                      "attnlab: block_step's cos/sin must be contiguous float32 of ", hd, " values (1 or ", M,
                      " rows), got ", cos->sizes());
    rope_stride = cos->numel() == hd ? 0 : hd;
  }
  Tensor out = at::empty(x.sizes(), x.options());
  const int64_t qw = H * hd, kw = n_kv * hd;
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
                       .eps = static_cast<float>(a["eps"].toDouble()),
                       .scale = static_cast<float>(a["scale"].toDouble()),
                       .x = x.const_data_ptr(),
                       .attn_norm = weight("attn_norm", {D}, false),
                       .wq = weight("wq", {qw, D}, false),
                       .wk = weight("wk", {kw, D}, false),
                       .wv = weight("wv", {kw, D}, false),
                       .bq = weight("bq", {qw}, true),
                       .bk = weight("bk", {kw}, true),
                       .bv = weight("bv", {kw}, true),
                       .wo = weight("wo", {D, qw}, false),
                       .bo = weight("bo", {D}, true),
                       .ffn_norm = weight("ffn_norm", {D}, false),
                       .w1 = weight("w1", {F, D}, false),
                       .w3 = weight("w3", {F, D}, false),
                       .w2 = weight("w2", {D, F}, false),
                       .b1 = weight("b1", {F}, true),
                       .b3 = weight("b3", {F}, true),
                       .b2 = weight("b2", {D}, true),
                       .cos = cos == nullptr ? nullptr : cos->const_data_ptr<float>(),
                       .sin = cos == nullptr ? nullptr : sin->const_data_ptr<float>(),
                       .cache_k = const_cast<void*>(operand(cache_k, x, "cache_k")),
                       .cache_v = const_cast<void*>(operand(cache_v, x, "cache_v")),
                       .out = out.mutable_data_ptr(),
                       .threads = at::get_num_threads()};
  check_rc(kernels::block_step(args), "block_step");
  a.result(out);
}

// amx(int on) -> int: on 0 or 1 turns the AMX path off or on, -1 leaves it; the features after (kernels.h).
void amx(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  Args a(op, stack);
  const int64_t on = a["on"].toInt();
  a.result(on < 0 ? kernels::features() : kernels::set_amx(on != 0));
}

template <auto F>
torch::CppFunction boxed() {
  return torch::CppFunction::makeFromBoxedFunction<F>();
}

}  // namespace
}  // namespace attnlab_fused

// TORCH_LIBRARY_IMPL pastes its namespace argument into names, so ATTNLAB_OPS is expanded through this macro first.
#define ATTNLAB_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

ATTNLAB_IMPL(ATTNLAB_OPS, CPU, m) {
  namespace f = attnlab_fused;
  m.impl("decode", f::boxed<f::decode>());
  m.impl("mla_decode", f::boxed<f::mla_decode>());
  m.impl("paged_decode", f::boxed<f::paged_decode>());
  m.impl("linear", f::boxed<f::linear>());
  m.impl("block_step", f::boxed<f::block_step>());
}

// amx takes no tensor, so no device picks its kernel: registered for every key.
ATTNLAB_IMPL(ATTNLAB_OPS, CompositeExplicitAutograd, m) { m.impl("amx", attnlab_fused::boxed<attnlab_fused::amx>()); }
