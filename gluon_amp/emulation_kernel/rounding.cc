// gluon-amp's emulation rounding: one MXNet operator, compiled on the user's machine.
//
// _gluon_amp_round(data, dtype="float16"|"bfloat16") holds float32 values rounded to the
// target dtype (gluon_amp_core/emulate.py: round_bits is the reference, bit for bit).
//   - One pass, in place where MXNet's memory planner allows it (FInplaceOption), and on
//     oneDNN's blocked layouts as they lie (rounding is elementwise), so the ops after it keep
//     their layout.
//   - Backward: float16 rounds the gradient to float16 (real AMP holds it there, and the loss
//     scaler must meet its overflows); bfloat16 passes the gradient through. Nothing of the
//     forward pass is kept for it.
//
// _gluon_amp_round_weight(data, weight, dtype=...) gives (data, weight rounded): the same
// rounding of an op's parameter, placed on the op's data input. Its backward gives (the data's
// gradient, the weight's gradient rounded) in one node, which the data's gradient passes
// through on its way to the ops before: MXNet runs it as the backward pass reaches the op,
// and the weight's gradient (a buffer of the op's backward) is freed then. A rounding of the
// weight alone is reached only from the parameter's gradient, which MXNet's order visits after
// the whole backward chain, so every op's weight gradient waited in a buffer until the end.
// The data passes through in place (FInplaceIdentity: even where other ops read it too).
//
// MXNet's amp_cast and amp_multicast get a gradient of their backward (1.9.1 has none), so a
// gradient of a gradient runs through the casts of any plan, native ones included.
//
// It is built against the headers MXNet's wheel ships, and loaded into a libmxnet.so built by
// another compiler (the 1.9.1 pip wheel: GCC 4.8, the old std::string ABI). Two rules follow:
//   1. std::function objects that libmxnet calls are made with invokers of the convention GCC
//      4.8 calls them with (arguments by value: OldAbi below). Newer libstdc++ passes them by
//      reference, which for a pointer or an int argument is another calling convention.
//   2. Nothing here creates or lays out an nnvm::Node: std::unordered_map (in NodeAttrs) changed
//      size after GCC 4.8. The backward node is made by libmxnet (MakeGradNode), and NodeAttrs
//      are only read (their op, name, and a dict lookup: the fields before the map's end).
//   3. Nothing here throws or uses C++ streams. A build by GCC 13 (Ubuntu 24.04) crashed the
//      process with SIGSEGV at its first error: first in LOG(FATAL) (whose exception must
//      unwind through libmxnet's GCC 4.8 frames), then in LOG(ERROR), right after the stream
//      had printed the file name, at the line number. A bad call makes an inference function
//      return false instead, after saying why with fprintf (say() below); libmxnet then raises
//      its own error.
// gluon_amp loads a build only after a fresh process has checked it (selftest.py).

#include <algorithm>
#include <cpuid.h>
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <dmlc/any.h>
#include <dmlc/logging.h>
#include <mxnet/base.h>
#include <mxnet/ndarray.h>
#include <mxnet/op_attr_types.h>
#include <nnvm/node.h>
#include <nnvm/op.h>
#include <nnvm/op_attr_types.h>

#define GA_OP_NAME "_gluon_amp_round"
#define GA_BACKWARD_OP_NAME "_backward_gluon_amp_round"
#define GA_PAIR_OP_NAME "_gluon_amp_round_weight"
#define GA_BACKWARD_PAIR_OP_NAME "_backward_gluon_amp_round_weight"
// Bump with any change of behaviour; gluon_amp checks it on load.
#define GA_KERNEL_VERSION 6

namespace gaabi {

// A std::function<R(A...)> whose invoker takes A... by value, as GCC 4.8's operator() calls it.
// The layout (functor, manager, invoker) is the same in every libstdc++ since 4.x.
template <typename Sig> struct OldAbi;
template <typename R, typename... A> struct OldAbi<R(A...)> {
  using Ptr = R (*)(A...);
  static R invoke(const std::_Any_data& d, A... a) { return (*d._M_access<Ptr>())(a...); }
  static std::function<R(A...)> make(Ptr p) {
    std::function<R(A...)> f(p);
    static_assert(sizeof(f) == 4 * sizeof(void*), "unexpected std::function layout");
    using Invoker = R (*)(const std::_Any_data&, A...);
    Invoker inv = &invoke;
    std::memcpy(reinterpret_cast<char*>(&f) + 3 * sizeof(void*), &inv, sizeof(void*));
    return f;
  }
};

// Marks a value for the set_attr specialisations below.
template <typename V> struct Attr { V value; };

}  // namespace gaabi

// nnvm::Op::set_attr hands libmxnet an updater std::function<void(any*)>: its own would be
// called with the wrong convention. An explicit specialisation is a member of Op, so it may
// call the private UpdateAttrMap with an OldAbi updater doing what set_attr's lambda does.
#define GA_SET_ATTR(V)                                                                        \
  namespace nnvm {                                                                            \
  template <>                                                                                 \
  inline Op& Op::set_attr<gaabi::Attr<V>>(const std::string& name, const gaabi::Attr<V>& v,  \
                                          int plevel) {                                       \
    static const V* value;                                                                    \
    static const std::string* attr_name;                                                      \
    static int level;                                                                         \
    static const Op* op;                                                                      \
    value = &v.value;                                                                         \
    attr_name = &name;                                                                        \
    level = plevel;                                                                           \
    op = this;                                                                                \
    struct Updater {                                                                          \
      static void run(dmlc::any* pmap) {                                                      \
        if (pmap->empty()) {                                                                  \
          OpMap<V> pm;                                                                        \
          pm.attr_name_ = *attr_name;                                                         \
          *pmap = std::move(pm);                                                              \
        }                                                                                     \
        std::vector<std::pair<V, int> >& vec = nnvm::get<OpMap<V> >(*pmap).data_;             \
        if (vec.size() <= op->index_) vec.resize(op->index_ + 1, std::make_pair(V(), 0));     \
        std::pair<V, int>& p = vec[op->index_];                                               \
        if (p.second < level) p = std::make_pair(*value, level);                              \
      }                                                                                       \
    };                                                                                        \
    UpdateAttrMap(name, gaabi::OldAbi<void(dmlc::any*)>::make(&Updater::run));               \
    return *this;                                                                             \
  }                                                                                           \
  }

GA_SET_ATTR(mxnet::FInferShape)
GA_SET_ATTR(nnvm::FInferType)
GA_SET_ATTR(mxnet::FInferStorageType)
GA_SET_ATTR(nnvm::FInplaceOption)
GA_SET_ATTR(nnvm::FInplaceIdentity)
GA_SET_ATTR(mxnet::FComputeEx)
GA_SET_ATTR(nnvm::FGradient)
GA_SET_ATTR(bool)  // TIsBackward, TIsMKLDNN

// Exported by libmxnet (src/operator/elemwise_op_common.h, not among the shipped headers): makes
// "<n's name>_backward" of op_name over inputs, with dict's attributes and a control dependency
// on n, as MXNet's own gradients do.
namespace mxnet {
namespace op {
std::vector<nnvm::NodeEntry> MakeGradNode(const char* op_name, const nnvm::ObjectPtr& n,
                                          const std::vector<nnvm::NodeEntry>& inputs,
                                          const std::unordered_map<std::string, std::string>& dict);
}  // namespace op
}  // namespace mxnet

namespace {

using mxnet::NDArray;
using mxnet::OpContext;
using mxnet::OpReqType;

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// bfloat16: round to nearest even on the bits; overflow carries into inf, subnormals and -0
// are kept; a NaN stays a NaN (quiet, payload cut).
inline uint32_t round_bf16(uint32_t u) {
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  uint32_t nan = (u | 0x00400000u) & 0xffff0000u;
  return (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
}

// float16: 11 significant bits to 2^-14, a quantum of 2^-24 below it (float16's subnormals),
// inf from 65520 on (the tie above 65504 rounds to even, out of range); sign and -0 kept.
inline uint32_t round_fp16(uint32_t u) {
  uint32_t sign = u & 0x80000000u, a = u & 0x7fffffffu;
  uint32_t normal = (a + 0xfffu + ((a >> 13) & 1u)) & 0xffffe000u;
  uint32_t tiny = bits_of((float_of(a) + 0.5f) - 0.5f);  // float32 arithmetic rounds to 2^-24
  uint32_t r = a < 0x38800000u ? tiny : normal;
  r = a >= 0x477ff000u ? 0x7f800000u : r;
  r = a > 0x7f800000u ? ((a | 0x00400000u) & 0xffffe000u) : r;
  return r | sign;
}

template <bool kHalf, bool kAdd>
__attribute__((target_clones("avx512f", "avx2", "default")))
void round_range(const uint32_t* in, uint32_t* out, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    uint32_t r = kHalf ? round_fp16(in[k]) : round_bf16(in[k]);
    if (kAdd) {
      out[k] = bits_of(float_of(out[k]) + float_of(r));
    } else {
      out[k] = r;
    }
  }
}

// float16 by the CPU's own conversions (F16C: every CPU with AVX2 has them), 8 values at a
// time: round_fp16's definition exactly (nearest even by the instruction's immediate, not
// MXCSR; subnormals kept and never flushed, as DAZ/FTZ do not apply to them; inf from 65520;
// a NaN quieted, its payload cut to float16's 10 bits). round_fp16's float32 step keeps GCC
// from vectorising it: 1 value per ns, where this is bound by memory.
template <bool kAdd>
__attribute__((target("avx2,f16c")))
void round_range_f16c(const uint32_t* in, uint32_t* out, int64_t n) {
  const float* i = reinterpret_cast<const float*>(in);
  float* o = reinterpret_cast<float*>(out);
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    __m256 r = _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(i + k), _MM_FROUND_TO_NEAREST_INT));
    if (kAdd) r = _mm256_add_ps(r, _mm256_loadu_ps(o + k));
    _mm256_storeu_ps(o + k, r);
  }
  round_range<true, kAdd>(in + k, out + k, n - k);
}

bool has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  static const bool yes = __builtin_cpu_supports("avx2") && __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
  return yes;
}

template <bool kHalf, bool kAdd>
void round_span(const float* in, float* out, int64_t n) {
  const uint32_t* i = reinterpret_cast<const uint32_t*>(in);
  uint32_t* o = reinterpret_cast<uint32_t*>(out);
  const int64_t chunk = 1 << 16;  // values per task: memory-bound, small arrays stay serial
  const int64_t tasks = (n + chunk - 1) / chunk;
  const bool f16c = kHalf && has_f16c();
#pragma omp parallel for schedule(static) if (tasks > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    int64_t begin = t * chunk, len = std::min(chunk, n - begin);
    if (f16c) {
      round_range_f16c<kAdd>(i + begin, o + begin, len);
    } else {
      round_range<kHalf, kAdd>(i + begin, o + begin, len);
    }
  }
}

void round_values(bool half, OpReqType req, const float* in, float* out, int64_t n) {
  if (req == mxnet::kAddTo) {
    half ? round_span<true, true>(in, out, n) : round_span<false, true>(in, out, n);
  } else {
    half ? round_span<true, false>(in, out, n) : round_span<false, false>(in, out, n);
  }
}

// One line on stderr: why an inference function refuses (rule 3: C stdio, no C++ stream).
void say(const nnvm::NodeAttrs& attrs, const char* what, const char* detail = "") {
  std::fprintf(stderr, "%s: %s%s\n", attrs.op->name.c_str(), what, detail);
  std::fflush(stderr);
}

// "(2,3,0)": a shape for say(), -1 for an unknown dimension or "()" for an unknown rank.
std::string shape_text(const mxnet::TShape& s) {
  std::string text = "(";
  if (mxnet::ndim_is_known(s)) {
    for (int d = 0; d < s.ndim(); ++d) {
      char dim[24];
      std::snprintf(dim, sizeof(dim), d ? ",%lld" : "%lld", static_cast<long long>(s[d]));
      text += dim;
    }
  }
  return text + ")";
}

// The target dtype, from the node's attributes (a lookup only: see rule 2 above): 1 for
// float16, 0 for bfloat16, -1 (said on stderr) for anything else.
int dtype_code(const nnvm::NodeAttrs& attrs) {
  auto it = attrs.dict.find("dtype");
  if (it == attrs.dict.end()) {
    say(attrs, "the attribute dtype is missing");
    return -1;
  }
  if (it->second == "float16") return 1;
  if (it->second == "bfloat16") return 0;
  say(attrs, "dtype must be float16 or bfloat16, got ", it->second.c_str());
  return -1;
}

// Only called once inference has accepted the node's dtype (MXNet infers before it computes
// or differentiates an op).
bool is_half(const nnvm::NodeAttrs& attrs) {
  auto it = attrs.dict.find("dtype");
  return it != attrs.dict.end() && it->second == "float16";
}

#if MXNET_USE_MKLDNN == 1
// libmxnet's out-of-line copies of two dnnl::memory members: the inline ones call oneDNN's C
// API, which libmxnet does not export. A const member function and a free function of its
// object pointer are called alike (the Itanium C++ ABI).
dnnl::memory::desc memory_desc(const dnnl::memory* m) __asm__("_ZNK4dnnl6memory8get_descEv");
void* memory_handle(const dnnl::memory* m) __asm__("_ZNK4dnnl6memory15get_data_handleEv");

// Elements a dense blocked float32 oneDNN memory spans from its handle (oneDNN's own size
// rule: memory_desc_wrapper::size), or -1 for anything else.
int64_t blocked_extent(const dnnl_memory_desc_t& md) {
  if (md.data_type != dnnl_f32 || md.format_kind != dnnl_blocked || md.extra.flags != 0) return -1;
  const dnnl_blocking_desc_t& bd = md.format_desc.blocking;
  int64_t blocks[DNNL_MAX_NDIMS];
  for (int d = 0; d < DNNL_MAX_NDIMS; ++d) blocks[d] = 1;
  for (int i = 0; i < bd.inner_nblks; ++i) blocks[bd.inner_idxs[i]] *= bd.inner_blks[i];
  int64_t extent = 0;
  for (int d = 0; d < md.ndims; ++d) {
    if (md.padded_dims[d] == 0) return 0;
    extent = std::max<int64_t>(extent, md.padded_dims[d] / blocks[d] * bd.strides[d]);
  }
  if (extent == 1 && bd.inner_nblks != 0) {
    extent = 1;
    for (int i = 0; i < bd.inner_nblks; ++i) extent *= bd.inner_blks[i];
  }
  return md.offset0 + extent;
}

// Round in place an array held in oneDNN's layout, where its output is the same chunk (so it
// keeps the layout): every element of the memory, padding included (rounding a zero keeps it).
// False when that is not the case or not a layout this understands.
bool round_mkldnn_in_place(bool half, const NDArray& in, const NDArray& out, OpReqType req) {
  if (req != mxnet::kWriteInplace || !out.IsMKLDNNData()) return false;
  mxnet::Storage::Handle storage = in.storage_handle();
  if (out.storage_handle().dptr != storage.dptr) return false;
  const dnnl::memory* mem = in.GetMKLDNNData();
  const int64_t extent = blocked_extent(memory_desc(mem).data);
  char* begin = static_cast<char*>(memory_handle(mem));
  char* base = static_cast<char*>(storage.dptr);
  if (extent < 0 || begin < base || begin + extent * sizeof(float) > base + storage.size) return false;
  float* p = reinterpret_cast<float*>(begin);
  round_values(half, mxnet::kWriteTo, p, p, extent);
  return true;
}
#endif

// out (req) <- in rounded.
void round_array(bool half, const NDArray& in, const NDArray& out, OpReqType req) {
  if (req == mxnet::kNullOp) return;
  const int64_t n = static_cast<int64_t>(in.shape().Size());
#if MXNET_USE_MKLDNN == 1
  if (in.IsMKLDNNData()) {
    if (round_mkldnn_in_place(half, in, out, req)) return;
    NDArray plain = in.Reorder2Default();
    if (out.IsMKLDNNData()) const_cast<NDArray&>(out).InvalidateMKLDNNData();
    round_values(half, req, plain.data().dptr<float>(), out.data().dptr<float>(), n);
    return;
  }
  if (out.IsMKLDNNData()) {
    if (req == mxnet::kAddTo) {  // out += round(in), out in oneDNN's layout: sum on a plain copy
      NDArray sum = out.Reorder2Default();
      round_values(half, mxnet::kAddTo, in.data().dptr<float>(), sum.data().dptr<float>(), n);
      const_cast<NDArray&>(out).InvalidateMKLDNNData();
      std::memcpy(out.data().dptr<float>(), sum.data().dptr<float>(), n * sizeof(float));
      return;
    }
    const_cast<NDArray&>(out).InvalidateMKLDNNData();
  }
#endif
  round_values(half, req, in.data().dptr<float>(), out.data().dptr<float>(), n);
}

// out (req) <- in as it is: nothing where MXNet placed the output on the input (kWriteInplace).
void pass_array(const NDArray& in, const NDArray& out, OpReqType req) {
  if (req == mxnet::kNullOp || req == mxnet::kWriteInplace) return;
  const int64_t n = static_cast<int64_t>(in.shape().Size());
  NDArray plain = in;
#if MXNET_USE_MKLDNN == 1
  if (in.IsMKLDNNData()) plain = in.Reorder2Default();
  if (out.IsMKLDNNData()) {
    if (req == mxnet::kAddTo) {
      NDArray sum = out.Reorder2Default();
      const float* a = plain.data().dptr<float>();
      float* b = sum.data().dptr<float>();
      for (int64_t k = 0; k < n; ++k) b[k] += a[k];
      const_cast<NDArray&>(out).InvalidateMKLDNNData();
      std::memcpy(out.data().dptr<float>(), b, n * sizeof(float));
      return;
    }
    const_cast<NDArray&>(out).InvalidateMKLDNNData();
  }
#endif
  const float* a = plain.data().dptr<float>();
  float* b = out.data().dptr<float>();
  if (req == mxnet::kAddTo) {
    for (int64_t k = 0; k < n; ++k) b[k] += a[k];
  } else if (a != b) {
    std::memcpy(b, a, n * sizeof(float));
  }
}

void compute(const nnvm::NodeAttrs& attrs, const OpContext& ctx, const std::vector<NDArray>& inputs,
             const std::vector<OpReqType>& req, const std::vector<NDArray>& outputs) {
  round_array(is_half(attrs), inputs[0], outputs[0], req[0]);
}

// The pair (forward and float16's backward alike): (a, b) -> (a, b rounded).
void compute_pair(const nnvm::NodeAttrs& attrs, const OpContext& ctx, const std::vector<NDArray>& inputs,
                  const std::vector<OpReqType>& req, const std::vector<NDArray>& outputs) {
  const bool half = is_half(attrs);
  pass_array(inputs[0], outputs[0], req[0]);
  round_array(half, inputs[1], outputs[1], req[1]);
}

// Every op here gives output k from input k: dense, float32, of its shape.
bool infer_storage(const nnvm::NodeAttrs& attrs, const int dev_mask, mxnet::DispatchMode* mode,
                   std::vector<int>* in, std::vector<int>* out) {
  for (int s : *in) {
    if (s != mxnet::kDefaultStorage && s != -1) {
      say(attrs, "takes dense arrays only");
      return false;
    }
  }
  for (int& s : *in) s = mxnet::kDefaultStorage;
  for (int& s : *out) s = mxnet::kDefaultStorage;
  *mode = mxnet::DispatchMode::kFComputeEx;
  return true;
}

// Input k and output k have one shape, known in part on either side: what one side knows (its
// rank, any dimension) goes to the other, as MXNet's elementwise ops do. A shape known only in
// part must pass too: an LSTM's zero begin state is (batch unknown, hidden), and the
// FullyConnected after the rounding learns the batch only once it sees its data's rank.
bool infer_shape(const nnvm::NodeAttrs& attrs, mxnet::ShapeVector* in, mxnet::ShapeVector* out) {
  if (dtype_code(attrs) < 0) return false;  // imperatively the first check MXNet makes
  bool known = true;
  for (size_t k = 0; k < out->size(); ++k) {
    mxnet::TShape& a = (*in)[k];
    mxnet::TShape& b = (*out)[k];
    if (!mxnet::ndim_is_known(a) && mxnet::ndim_is_known(b)) {
      a = b;
    } else if (mxnet::ndim_is_known(a) && !mxnet::ndim_is_known(b)) {
      b = a;
    } else if (mxnet::ndim_is_known(a) && mxnet::ndim_is_known(b)) {
      if (a.ndim() != b.ndim()) {
        say(attrs, "an input and its output differ in shape: ", (shape_text(a) + " " + shape_text(b)).c_str());
        return false;
      }
      for (int d = 0; d < a.ndim(); ++d) {
        if (!mxnet::dim_size_is_known(a[d])) {
          a[d] = b[d];
        } else if (!mxnet::dim_size_is_known(b[d])) {
          b[d] = a[d];
        } else if (a[d] != b[d]) {
          say(attrs, "an input and its output differ in shape: ", (shape_text(a) + " " + shape_text(b)).c_str());
          return false;
        }
      }
    }
    known = known && mxnet::shape_is_known(b);
  }
  return known;
}

bool infer_type(const nnvm::NodeAttrs& attrs, std::vector<int>* in, std::vector<int>* out) {
  if (dtype_code(attrs) < 0) return false;  // a bad dtype fails here when a graph is typed
  for (std::vector<int>* side : {in, out}) {
    for (int t : *side) {
      if (t != -1 && t != mshadow::kFloat32) {
        say(attrs, "takes and gives float32, got a type flag ", std::to_string(t).c_str());
        return false;
      }
    }
  }
  for (std::vector<int>* side : {in, out}) {
    for (int& t : *side) t = mshadow::kFloat32;
  }
  return true;
}

std::vector<std::pair<int, int> > inplace(const nnvm::NodeAttrs& attrs) { return {{0, 0}}; }
std::vector<std::pair<int, int> > inplace_pair(const nnvm::NodeAttrs& attrs) { return {{0, 0}, {1, 1}}; }
// The pair's data is its output unchanged: in place even where other ops read it.
std::vector<bool> identity_pair(const nnvm::NodeAttrs& attrs) { return {true, false}; }

std::vector<nnvm::NodeEntry> gradient(const nnvm::ObjectPtr& n, const std::vector<nnvm::NodeEntry>& ograds) {
  if (!is_half(n->attrs)) return {ograds[0]};
  // libmxnet makes the node (its layout) and copies the forward node's attributes from its
  // own dict: this code passes that map along and never reads past its address.
  return mxnet::op::MakeGradNode(GA_BACKWARD_OP_NAME, n, {ograds[0]}, n->attrs.dict);
}

std::vector<nnvm::NodeEntry> gradient_pair(const nnvm::ObjectPtr& n, const std::vector<nnvm::NodeEntry>& ograds) {
  if (!is_half(n->attrs)) return {ograds[0], ograds[1]};
  return mxnet::op::MakeGradNode(GA_BACKWARD_PAIR_OP_NAME, n, {ograds[0], ograds[1]}, n->attrs.dict);
}

// MXNet's own casts, which plans insert (amp_cast, amp_multicast): 1.9.1 gives their backward
// ops no gradient, so a gradient of a gradient through a plan (a gradient penalty) raised
// "_backward_amp_cast is non-differentiable". A cast's backward casts each output gradient to
// its forward input's dtype; its gradient casts each one back. That is the same backward op
// again, with a control dependency on the one it differentiates: a backward op's dtypes come
// from the node it depends on (MXNet infers them through that node's gradient), so each cast
// goes back to the dtype it came from. amp_cast with the forward's dtype could not do it for
// amp_multicast, whose output dtype is the widest of all its inputs', some of them gradients
// nobody asked for (zeros of no known dtype), and has no attribute that names it.
std::vector<nnvm::NodeEntry> gradient_of_cast_backward(const nnvm::ObjectPtr& n,
                                                       const std::vector<nnvm::NodeEntry>& ograds) {
  return mxnet::op::MakeGradNode(n->attrs.op->name.c_str(), n, ograds, n->attrs.dict);
}

template <typename Sig>
gaabi::Attr<std::function<Sig> > fn(Sig* p) {
  return {gaabi::OldAbi<Sig>::make(p)};
}

// One array (the rounding) or two (the pair), in and out.
void define(nnvm::Op& op, bool pair) {
  op.set_num_inputs(pair ? 2 : 1);
  op.set_num_outputs(pair ? 2 : 1);
  op.set_attr<gaabi::Attr<mxnet::FInferShape> >("FInferShape", fn(&infer_shape), 10);
  op.set_attr<gaabi::Attr<nnvm::FInferType> >("FInferType", fn(&infer_type), 10);
  op.set_attr<gaabi::Attr<mxnet::FInferStorageType> >("FInferStorageType", fn(&infer_storage), 10);
  op.set_attr<gaabi::Attr<nnvm::FInplaceOption> >("FInplaceOption", fn(pair ? &inplace_pair : &inplace), 10);
  if (pair) op.set_attr<gaabi::Attr<nnvm::FInplaceIdentity> >("FInplaceIdentity", fn(&identity_pair), 10);
  op.set_attr<gaabi::Attr<mxnet::FComputeEx> >("FComputeEx<cpu>", fn(pair ? &compute_pair : &compute), 10);
#if MXNET_USE_MKLDNN == 1
  // oneDNN arrays reach compute() as they are (MXNet would otherwise copy them to a plain one)
  op.set_attr<gaabi::Attr<bool> >("TIsMKLDNN", {true}, 10);
#endif
}

// Gives MXNet's op `name` a gradient where it has none: set_attr keeps an FGradient MXNet
// registered (at the same level), and an op this MXNet lacks is left alone (Find, not
// __REGISTER_OR_GET__, which would register an empty one).
void give_gradient(const char* name,
                   std::vector<nnvm::NodeEntry> (*gradient_fn)(const nnvm::ObjectPtr&,
                                                               const std::vector<nnvm::NodeEntry>&)) {
  const nnvm::Op* op = ::dmlc::Registry<nnvm::Op>::Find(name);
  if (op != nullptr) {
    const_cast<nnvm::Op*>(op)->set_attr<gaabi::Attr<nnvm::FGradient> >("FGradient", fn(gradient_fn), 10);
  }
}

struct Registration {
  Registration() {
    nnvm::Op& forward = ::dmlc::Registry<nnvm::Op>::Get()->__REGISTER_OR_GET__(GA_OP_NAME);
    define(forward, false);
    forward.describe("float32 values rounded to float16 or bfloat16 (gluon_amp's emulation)");
    forward.add_argument("data", "NDArray-or-Symbol", "float32 values");
    forward.set_attr<gaabi::Attr<nnvm::FGradient> >("FGradient", fn(&gradient), 10);
    nnvm::Op& backward = ::dmlc::Registry<nnvm::Op>::Get()->__REGISTER_OR_GET__(GA_BACKWARD_OP_NAME);
    define(backward, false);
    backward.set_attr<gaabi::Attr<bool> >("TIsBackward", {true}, 10);
    // A gradient of a gradient (a gradient penalty: autograd.grad(..., create_graph=True), then
    // backward): the backward rounds its output gradient as the forward's gradient does.
    backward.set_attr<gaabi::Attr<nnvm::FGradient> >("FGradient", fn(&gradient), 10);
    nnvm::Op& pair = ::dmlc::Registry<nnvm::Op>::Get()->__REGISTER_OR_GET__(GA_PAIR_OP_NAME);
    define(pair, true);
    pair.describe("(data, weight) -> (data, weight rounded to float16 or bfloat16): gluon_amp's emulation");
    pair.add_argument("data", "NDArray-or-Symbol", "float32 values, passed through");
    pair.add_argument("weight", "NDArray-or-Symbol", "float32 values, rounded");
    pair.set_attr<gaabi::Attr<nnvm::FGradient> >("FGradient", fn(&gradient_pair), 10);
    nnvm::Op& pair_backward = ::dmlc::Registry<nnvm::Op>::Get()->__REGISTER_OR_GET__(GA_BACKWARD_PAIR_OP_NAME);
    define(pair_backward, true);
    pair_backward.set_attr<gaabi::Attr<bool> >("TIsBackward", {true}, 10);
    pair_backward.set_attr<gaabi::Attr<nnvm::FGradient> >("FGradient", fn(&gradient_pair), 10);
    give_gradient("_backward_amp_cast", &gradient_of_cast_backward);
    give_gradient("_backward_amp_multicast", &gradient_of_cast_backward);
  }
};

Registration registration;

}  // namespace

extern "C" __attribute__((visibility("default"))) int gluon_amp_kernel_version() { return GA_KERNEL_VERSION; }
