// normswap CPU fast path for (fused add +) RMSNorm: forward and backward over [N, H] rows.
//
// Built at first use by normswap/kernels/cpu.py (torch.utils.cpp_extension.load) and cached.
// Design (why it is shaped like this):
// * One translation unit holds the row kernels twice (rms_norm_cpu_kernel.h): a baseline x86-64
//   (SSE2) variant and an AVX2+FMA+F16C variant made with `#pragma GCC target`, and picks one at
//   load time from the CPU's flags. No -march=native: the cached .so stays valid if the cache
//   directory is shared with, or copied to, another machine.
// * Threads come from ATen's intra-op pool via at::parallel_for, so torch.set_num_threads
//   governs this kernel exactly like F.layer_norm. ATen's OpenMP backend implements
//   parallel_for inline in a header, so the extension must be compiled with -fopenmp or it runs
//   serially (cpu.py passes the flag when torch uses OpenMP).
// * Rows are handed out in contiguous blocks (one per thread), not one row per task.
// * Backward writes dweight as one fp32 partial row per block, summed at the end.
//
// * `norm` is the whole eager call in one C++ function (rows of any leading shape, grad-mode check, a C++
//   autograd node when a gradient is needed): a Python autograd.Function plus Python-side checks
//   cost ~40 µs a call, more than the arithmetic of a decode-sized norm and twice F.layer_norm's
//   own overhead.
//
// Headers: only what is used (ATen tensor + a few factory ops + parallel_for + the C++ autograd
// Function + torch's pybind casters). <torch/extension.h> would pull in all of libtorch's C++ API and makes the one-time
// build several times slower (measured ~100 s vs ~20 s of parsing on a busy 2-core machine).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#if defined(__FLT16_MANT_DIG__) && defined(__GNUC__) && !defined(__clang__)
#define NORMSWAP_HAVE_FLOAT16 1
#endif

namespace normswap_cpu {

struct FwdArgs {
  const void* x;
  const void* res;
  const void* w;
  const float* b;  // bias, fp32 holding values rounded to x's dtype; null when absent
  void* y;
  void* summed;
  float* rstd;
  int64_t H;
  float eps;
};

struct BwdArgs {
  const void* dy;
  const void* x;
  const float* rstd;
  const void* w;
  void* dx;
  int64_t H;
};

typedef void (*FwdFn)(const FwdArgs&, int64_t, int64_t);
typedef void (*BwdFn)(const BwdArgs&, float*, int64_t, int64_t);

struct Table {
  FwdFn fwd[3][2][2][2];
  BwdFn bwd[3][2][2];
};

#define NORMSWAP_ISA_NS isa_baseline
#include "rms_norm_cpu_kernel.h"
#undef NORMSWAP_ISA_NS

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define NORMSWAP_HAVE_AVX2 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define NORMSWAP_ISA_NS isa_avx2
#include "rms_norm_cpu_kernel.h"
#undef NORMSWAP_ISA_NS
#pragma GCC pop_options
#endif

static const Table g_baseline = isa_baseline::make_table();
#ifdef NORMSWAP_HAVE_AVX2
static const Table g_avx2 = isa_avx2::make_table();
#endif

static bool cpu_has_avx2() {
#ifdef NORMSWAP_HAVE_AVX2
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

static const Table* g_table = nullptr;
static const char* g_isa = "baseline";

static void select_best() {
#ifdef NORMSWAP_HAVE_AVX2
  if (cpu_has_avx2()) {
    g_table = &g_avx2;
    g_isa = "avx2";
    return;
  }
#endif
  g_table = &g_baseline;
  g_isa = "baseline";
}

// For tests and benchmarks: force a variant ("baseline", "avx2", or "best"). Returns false (and
// changes nothing) when this build or this CPU cannot run the requested one.
static bool set_isa(const std::string& name) {
  if (name == "best") {
    select_best();
    return true;
  }
  if (name == "baseline") {
    g_table = &g_baseline;
    g_isa = "baseline";
    return true;
  }
#ifdef NORMSWAP_HAVE_AVX2
  if (name == "avx2" && cpu_has_avx2()) {
    g_table = &g_avx2;
    g_isa = "avx2";
    return true;
  }
#endif
  return false;
}

static std::string isa() { return g_isa; }

static int dtype_index(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return 0;
    case at::kBFloat16:
      return 1;
#ifdef NORMSWAP_HAVE_FLOAT16
    case at::kHalf:
      return 2;
#endif
    default:
      return -1;
  }
}

static bool supports(const std::string& name) {
  if (name == "float32") return true;
  if (name == "bfloat16") return true;
#ifdef NORMSWAP_HAVE_FLOAT16
  if (name == "float16") return true;
#endif
  return false;
}

// Rows per parallel block: below ~16k elements a row block is not worth waking a second thread.
static int64_t grain_rows(int64_t H) { return std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(H, 1)); }

static void check_rows(const at::Tensor& t, const char* name, bool any_rank = false) {
  TORCH_CHECK(t.device().is_cpu(), "normswap cpu kernel: ", name, " must be a CPU tensor");
  TORCH_CHECK(any_rank ? t.dim() >= 1 : t.dim() == 2, "normswap cpu kernel: ", name, " must be 2-D [N, H], got ",
              t.dim(), "-D");
  TORCH_CHECK(t.is_contiguous(), "normswap cpu kernel: ", name, " must be contiguous");
}

// Rows of a contiguous [..., H] tensor: the kernels read data pointers, so the leading shape needs
// no reshape (a reshape or view is an ATen call, and under autograd a ViewBackward0 node, each way).
static int64_t rows_of(const at::Tensor& t) {
  const int64_t H = t.size(-1);
  return H == 0 ? 0 : t.numel() / H;
}

// The weight as a contiguous fp32 tensor (undefined when absent). Converting a bf16/fp16 weight
// here once (H elements) is cheaper than converting it in every row.
static at::Tensor prepare_weight(const c10::optional<at::Tensor>& weight, const at::Tensor& x) {
  if (!weight.has_value() || !weight->defined()) return at::Tensor();
  const at::Tensor& w = *weight;
  TORCH_CHECK(w.device().is_cpu(), "normswap cpu kernel: weight must be a CPU tensor");
  TORCH_CHECK(w.numel() == x.size(-1), "normswap cpu kernel: weight has ", w.numel(), " elements, expected ",
              x.size(-1));
  if (w.scalar_type() == at::kFloat && w.is_contiguous()) return w;
  return w.to(at::kFloat).contiguous();
}

// The bias as a contiguous fp32 tensor of values rounded to x's dtype (undefined when absent), so
// the row kernel's `round(y) + b` is exactly a separate `y + bias.to(y.dtype)`.
static at::Tensor prepare_bias(const c10::optional<at::Tensor>& bias, const at::Tensor& x) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  const at::Tensor& b = *bias;
  TORCH_CHECK(b.device().is_cpu(), "normswap cpu kernel: bias must be a CPU tensor");
  TORCH_CHECK(b.numel() == x.size(-1), "normswap cpu kernel: bias has ", b.numel(), " elements, expected ",
              x.size(-1));
  if (b.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat && b.is_contiguous()) return b;
  const at::Tensor r = b.scalar_type() == x.scalar_type() ? b : b.to(x.scalar_type());
  return r.to(at::kFloat).contiguous();
}

// y (+ bias), rstd, summed; `bias` is optional so the Python-facing `forward` keeps its contract.
static std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_biased(const at::Tensor& x,
                                                                     const c10::optional<at::Tensor>& weight,
                                                                     const c10::optional<at::Tensor>& residual,
                                                                     const c10::optional<at::Tensor>& bias, double eps,
                                                                     bool any_rank = false) {
  check_rows(x, "x", any_rank);
  const int d = dtype_index(x.scalar_type());
  TORCH_CHECK(d >= 0, "normswap cpu kernel: unsupported dtype ", x.scalar_type());
  const int64_t N = rows_of(x), H = x.size(-1);
  TORCH_CHECK(H >= 1, "normswap cpu kernel: hidden size must be >= 1");
  const at::Tensor w = prepare_weight(weight, x);
  const int wk = w.defined() ? 1 : 0;
  at::Tensor res;
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) {
    res = *residual;
    TORCH_CHECK(res.sizes() == x.sizes(), "normswap cpu kernel: residual shape ", res.sizes(), " != x shape ",
                x.sizes());
    TORCH_CHECK(res.device().is_cpu(), "normswap cpu kernel: residual must be a CPU tensor");
    if (res.scalar_type() != x.scalar_type()) res = res.to(x.scalar_type());
    if (!res.is_contiguous()) res = res.contiguous();
  }
  const at::Tensor b = prepare_bias(bias, x);
  const int bk = b.defined() ? 1 : 0;
  // at::empty, not empty_like: one ATen call each instead of empty_like's two (it allocates through empty_strided)
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor rstd = at::empty({N}, x.options().dtype(at::kFloat));
  at::Tensor summed = has_res ? at::empty(x.sizes(), x.options()) : at::Tensor();
  FwdArgs a;
  a.x = x.data_ptr();
  a.res = has_res ? res.data_ptr() : nullptr;
  a.w = wk ? w.data_ptr() : nullptr;
  a.b = bk ? b.data_ptr<float>() : nullptr;
  a.y = y.data_ptr();
  a.summed = has_res ? summed.data_ptr() : nullptr;
  a.rstd = rstd.data_ptr<float>();
  a.H = H;
  a.eps = static_cast<float>(eps);
  const FwdFn fn = g_table->fwd[d][wk][has_res ? 1 : 0][bk];
  at::parallel_for(0, N, grain_rows(H), [&](int64_t r0, int64_t r1) { fn(a, r0, r1); });
  return {y, rstd, summed};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                                                       const c10::optional<at::Tensor>& residual, double eps) {
  return forward_biased(x, weight, residual, c10::nullopt, eps);
}

static std::tuple<at::Tensor, at::Tensor> backward_rows(const at::Tensor& dy, const at::Tensor& x,
                                                       const at::Tensor& rstd, const c10::optional<at::Tensor>& weight,
                                                       bool compute_dweight, bool any_rank) {
  check_rows(x, "x", any_rank);
  check_rows(dy, "dy", any_rank);
  const int d = dtype_index(x.scalar_type());
  TORCH_CHECK(d >= 0, "normswap cpu kernel: unsupported dtype ", x.scalar_type());
  TORCH_CHECK(dy.sizes() == x.sizes(), "normswap cpu kernel: dy shape ", dy.sizes(), " != x shape ", x.sizes());
  at::Tensor g = dy.scalar_type() == x.scalar_type() ? dy : dy.to(x.scalar_type());
  const int64_t N = rows_of(x), H = x.size(-1);
  TORCH_CHECK(H >= 1, "normswap cpu kernel: hidden size must be >= 1");
  TORCH_CHECK(rstd.device().is_cpu() && rstd.scalar_type() == at::kFloat && rstd.numel() == N &&
                  rstd.is_contiguous(),
              "normswap cpu kernel: rstd must be a contiguous float32 CPU tensor of N elements");
  const at::Tensor w = prepare_weight(weight, x);
  const int wk = w.defined() ? 1 : 0;
  const bool dw = wk != 0 && compute_dweight;
  at::Tensor dx = at::empty(x.sizes(), x.options());
  BwdArgs a;
  a.dy = g.data_ptr();
  a.x = x.data_ptr();
  a.rstd = rstd.data_ptr<float>();
  a.w = wk ? w.data_ptr() : nullptr;
  a.dx = dx.data_ptr();
  a.H = H;
  const BwdFn fn = g_table->bwd[d][wk][dw ? 1 : 0];
  if (!dw) {
    at::parallel_for(0, N, grain_rows(H), [&](int64_t b, int64_t e) { fn(a, nullptr, b, e); });
    return {dx, at::Tensor()};
  }
  // One contiguous row block per pool thread, each with its own fp32 dweight partial. The block
  // boundaries depend only on N and the thread count, so dweight is reproducible for a fixed
  // torch.get_num_threads().
  const int64_t grain = grain_rows(H);
  int64_t blocks = std::min<int64_t>(at::get_num_threads(), (N + grain - 1) / grain);
  blocks = std::max<int64_t>(blocks, 1);
  // one block: the partial is dweight itself, allocated [H] (no view of a [1, H] one)
  at::Tensor partial = blocks == 1 ? at::zeros({H}, x.options().dtype(at::kFloat))
                                   : at::zeros({blocks, H}, x.options().dtype(at::kFloat));
  float* pp = partial.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) fn(a, pp + k * H, N * k / blocks, N * (k + 1) / blocks);
  });
  at::Tensor dweight = blocks == 1 ? partial : partial.sum(0);
  return {dx, dweight};
}

std::tuple<at::Tensor, at::Tensor> backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& rstd,
                                            const c10::optional<at::Tensor>& weight, bool compute_dweight) {
  return backward_rows(dy, x, rstd, weight, compute_dweight, false);
}

// The autograd node of `norm`: saves the normalised tensor (x + residual when fused), rstd and
// the weight; the backward is the fused kernel above. x and residual get the same gradient, as
// they would from PyTorch's own `x + residual`; the summed stream's own gradient is added to it.
// The bias's gradient is dy summed over the rows (in y's dtype, then the bias's: what autograd
// gives a separate `y + bias.to(y.dtype)`). Whether a residual was fused is told by the number
// of outputs (no saved_data map to fill).
struct NormFunction : public torch::autograd::Function<NormFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const c10::optional<at::Tensor>& weight,
                                                const c10::optional<at::Tensor>& residual,
                                                const c10::optional<at::Tensor>& bias, double eps) {
    auto out = normswap_cpu::forward_biased(x, weight, residual, bias, eps, true);
    const at::Tensor& y = std::get<0>(out);
    const at::Tensor& rstd = std::get<1>(out);
    const at::Tensor& summed = std::get<2>(out);
    const bool has_res = summed.defined();
    ctx->save_for_backward({has_res ? summed : x, rstd, weight.has_value() ? *weight : at::Tensor(),
                            bias.has_value() ? *bias : at::Tensor()});
    if (has_res) return {y, summed};
    return {y};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& xin = saved[0];
    const at::Tensor& rstd = saved[1];
    const at::Tensor& w = saved[2];
    const at::Tensor& bias = saved[3];
    const bool has_res = grads.size() > 1;
    at::Tensor dy = !grads[0].defined()       ? at::zeros(xin.sizes(), xin.options())
                    : grads[0].is_contiguous() ? grads[0]
                                               : grads[0].contiguous();
    c10::optional<at::Tensor> wopt;
    if (w.defined()) wopt = w;
    auto g = normswap_cpu::backward_rows(dy, xin, rstd, wopt, w.defined() && ctx->needs_input_grad(1), true);
    at::Tensor dx = std::get<0>(g);
    at::Tensor dw = std::get<1>(g);
    if (has_res && grads[1].defined()) dx.add_(grads[1]);  // dx is this node's own fresh tensor
    if (dw.defined() && dw.scalar_type() != w.scalar_type()) dw = dw.to(w.scalar_type());
    at::Tensor db;
    // needs_input_grad counts only the tensors that were given: x, [weight], [residual], bias
    const size_t bias_edge = 1 + (w.defined() ? 1 : 0) + (has_res ? 1 : 0);
    if (bias.defined() && ctx->needs_input_grad(bias_edge)) {
      // dy summed over every leading dimension (a 1-D x is one row: its dy as it is)
      std::vector<int64_t> lead(dy.dim() - 1);
      for (int64_t i = 0; i + 1 < dy.dim(); ++i) lead[i] = i;
      db = lead.empty() ? dy.clone() : dy.sum(lead);
      if (db.scalar_type() != bias.scalar_type()) db = db.to(bias.scalar_type());
    }
    return {dx, dw, has_res ? dx : at::Tensor(), db, at::Tensor()};
  }
};

// The argument checks of the Python API (normswap.kernels.rms_norm), raised as ValueError like
// there, so that the module's direct call needs no Python-side checks of its own.
static void check_norm_args(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                            const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& bias) {
  if (x.dim() < 1) throw py::value_error("rms_norm: x must have at least one dimension");
  const int64_t H = x.size(-1);
  if (weight.has_value() && weight->defined() && (weight->dim() != 1 || weight->size(0) != H))
    throw py::value_error("rms_norm: weight has shape " + c10::str(weight->sizes()) + ", expected (" +
                          std::to_string(H) + ",)");
  if (bias.has_value() && bias->defined() && (bias->dim() != 1 || bias->size(0) != H))
    throw py::value_error("rms_norm: bias has shape " + c10::str(bias->sizes()) + ", expected (" +
                          std::to_string(H) + ",)");
  if (residual.has_value() && residual->defined()) {
    if (residual->sizes() != x.sizes())
      throw py::value_error("rms_norm: residual shape " + c10::str(residual->sizes()) + " differs from x " +
                            c10::str(x.sizes()));
    if (residual->scalar_type() != x.scalar_type())
      throw py::value_error("rms_norm: the compiled kernel's direct call needs residual in x's dtype");
  }
}

// RMSNorm of x over its last dimension (any leading shape), + bias when given: y, or (y, x +
// residual). x and residual must share a dtype the kernel supports; weight and bias may have any
// float dtype (the bias is rounded to y's dtype before the add, as `y + bias.to(y.dtype)` would).
// The whole eager call in one C++ function: checks, rows of any leading shape, grad-mode check, the C++
// autograd node only when a gradient is needed.
static std::vector<at::Tensor> norm_impl(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                                         const c10::optional<at::Tensor>& residual,
                                         const c10::optional<at::Tensor>& bias, double eps) {
  check_norm_args(x, weight, residual, bias);
  // the kernels take any leading shape (rows_of): no reshape to 2-D and back, which under autograd
  // were a reshape and a view with a ViewBackward0 node each, and a reshape more in the backward
  const at::Tensor x2 = x.is_contiguous() ? x : x.contiguous();
  c10::optional<at::Tensor> r2;
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) r2 = residual->is_contiguous() ? *residual : residual->contiguous();
  const bool has_w = weight.has_value() && weight->defined();
  const bool has_b = bias.has_value() && bias->defined();
  const bool grad = at::GradMode::is_enabled() &&
                    (x.requires_grad() || (has_w && weight->requires_grad()) ||
                     (has_res && residual->requires_grad()) || (has_b && bias->requires_grad()));
  std::vector<at::Tensor> out;
  // the bias is added inside the row kernel (no second op, no second pass over y)
  const c10::optional<at::Tensor> b = has_b ? bias : c10::optional<at::Tensor>();
  if (grad) {
    out = NormFunction::apply(x2, weight, r2, b, eps);
  } else {
    auto f = normswap_cpu::forward_biased(x2, weight, r2, b, eps, true);
    out.push_back(std::get<0>(f));
    if (has_res) out.push_back(std::get<2>(f));
  }
  return out;
}

at::Tensor norm(const at::Tensor& x, const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
                double eps) {
  return norm_impl(x, weight, c10::nullopt, bias, eps)[0];
}

std::tuple<at::Tensor, at::Tensor> add_norm(const at::Tensor& x, const at::Tensor& residual,
                                            const c10::optional<at::Tensor>& weight,
                                            const c10::optional<at::Tensor>& bias, double eps) {
  auto out = norm_impl(x, weight, residual, bias, eps);
  return {out[0], out[1]};
}


// Token embedding with each looked-up row centred (row − its mean), in one call: what a converted
// model's tied table needs per token (the table stays uncentred because the output head reads it).
// Decode looks up one row a step; as three ATen ops (lookup, lookup of the cached means,
// subtraction) the dispatcher overhead was ~2.5× a plain lookup at width 96, more than the
// arithmetic. Without gradient only (the caller takes the ATen formula otherwise); float32 and
// float64 tables; the mean is accumulated in double (float64 exact to rounding as the formula).
template <typename T>
static void centered_rows(const T* table, const int64_t* ids, T* out, int64_t n, int64_t H) {
  at::parallel_for(0, n, grain_rows(H), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* row = table + ids[i] * H;
      double sum = 0.0;
      for (int64_t j = 0; j < H; ++j) sum += static_cast<double>(row[j]);
      const T mean = static_cast<T>(sum / static_cast<double>(H));
      T* o = out + i * H;
      for (int64_t j = 0; j < H; ++j) o[j] = row[j] - mean;
    }
  });
}

at::Tensor centered_embedding(const at::Tensor& table, const at::Tensor& ids) {
  TORCH_CHECK(table.device().is_cpu() && ids.device().is_cpu(), "centered_embedding: CPU tensors only");
  TORCH_CHECK(table.dim() == 2 && table.is_contiguous(), "centered_embedding: a contiguous [V, H] table");
  TORCH_CHECK(ids.scalar_type() == at::kLong, "centered_embedding: int64 ids");
  const at::Tensor flat = ids.reshape({-1}).contiguous();
  const int64_t n = flat.numel(), V = table.size(0), H = table.size(1);
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    if (id[i] < 0 || id[i] >= V) throw py::index_error("index out of range in self");
  }
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(H);
  at::Tensor out = at::empty(shape, table.options());
  if (table.scalar_type() == at::kFloat) {
    centered_rows(table.data_ptr<float>(), id, out.data_ptr<float>(), n, H);
  } else if (table.scalar_type() == at::kDouble) {
    centered_rows(table.data_ptr<double>(), id, out.data_ptr<double>(), n, H);
  } else {
    throw py::type_error("centered_embedding: float32 or float64 tables only");
  }
  return out;
}

}  // namespace normswap_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  normswap_cpu::select_best();
  m.def("forward", &normswap_cpu::forward, "RMSNorm forward: (y, rstd fp32, x + residual or None)",
        py::arg("x"), py::arg("weight"), py::arg("residual"), py::arg("eps"));
  m.def("backward", &normswap_cpu::backward, "RMSNorm backward: (dx, dweight fp32 or None)", py::arg("dy"),
        py::arg("x"), py::arg("rstd"), py::arg("weight"), py::arg("compute_dweight") = true);
  m.def("norm", &normswap_cpu::norm, "RMSNorm over the last dim (+ bias), differentiable: y", py::arg("x"),
        py::arg("weight"), py::arg("bias"), py::arg("eps"));
  m.def("add_norm", &normswap_cpu::add_norm,
        "RMSNorm of x + residual over the last dim (+ bias), differentiable: (y, x + residual)", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("bias"), py::arg("eps"));
  m.def("centered_embedding", &normswap_cpu::centered_embedding,
        "rows of a [V, H] table looked up by int64 ids, each minus its mean (no gradient)", py::arg("table"),
        py::arg("ids"));
  m.def("isa", &normswap_cpu::isa, "instruction-set variant in use");
  m.def("set_isa", &normswap_cpu::set_isa, "force 'baseline', 'avx2' or 'best'; False if unavailable");
  m.def("supports", &normswap_cpu::supports, "whether a dtype name (e.g. 'bfloat16') is supported");
}
