"""Op classes for target dtype bfloat16.

CPU through oneDNN. Only ops whose bfloat16 kernels were run on this build are
neutral or low precision; the rest are float32. Data-movement ops (reshape, slice, concat,
pooling, relu) stay neutral so a bfloat16 tensor is not cast back and forth. Element-wise
math outside oneDNN (x*scalar, clip, sigmoid, sqrt...) runs an unvectorised bfloat16 loop in
MXNet 1.9, 2.5-6x slower than float32 (measured), so those ops are float32.

Data only: ``gluon_amp_core.table`` validates it against the registry.
"""
from . import common

# Run in bfloat16: every float input is cast to it.
LOW_PRECISION = """
Convolution FullyConnected
""".split()

# Run in float32: every float input is cast to float32.
FP32 = """
BatchNorm_v1 BilinearSampler CTCLoss Convolution_v1 Crop Custom Deconvolution Dropout Embedding
GridGenerator GroupNorm IdentityAttachKLSparseReg InstanceNorm L2Normalization LayerNorm
LinearRegressionOutput LogisticRegressionOutput MAERegressionOutput MakeLoss Pad Pooling_v1 RNN
ROIPooling SVMOutput SequenceLast SequenceMask SequenceReverse SoftmaxActivation SoftmaxOutput
SpatialTransformer SwapAxis UpSampling _CustomFunction _NDArray _Native _contrib_BilinearResize2D
_contrib_DeformableConvolution _contrib_DeformablePSROIPooling
_contrib_ModulatedDeformableConvolution _contrib_RROIAlign _contrib_SparseEmbedding
_contrib_SyncBatchNorm _contrib_allclose _contrib_bipartite_matching _contrib_boolean_mask
_contrib_box_decode _contrib_box_encode _contrib_count_sketch _contrib_dequantize
_contrib_div_sqrt_dim _contrib_fft _contrib_getnnz _contrib_gradientmultiplier _contrib_hawkesll
_contrib_ifft _contrib_index_array _contrib_index_copy _contrib_interleaved_matmul_encdec_qk
_contrib_interleaved_matmul_encdec_valatt _contrib_interleaved_matmul_selfatt_qk
_contrib_interleaved_matmul_selfatt_valatt _contrib_quadratic _contrib_quantize
_contrib_quantize_v2 _contrib_quantized_act _contrib_quantized_concat _contrib_quantized_conv
_contrib_quantized_elemwise_add _contrib_quantized_flatten _contrib_quantized_fully_connected
_contrib_quantized_pooling _contrib_requantize _copyto _cvcopyMakeBorder _cvimdecode _cvimresize
_div_scalar _equal_scalar _grad_add _greater_equal_scalar _greater_scalar _histogram _hypot
_hypot_scalar _identity_with_attr_like_rhs _image_adjust_lighting _image_crop
_image_flip_left_right _image_flip_top_bottom _image_normalize _image_random_brightness
_image_random_color_jitter _image_random_contrast _image_random_flip_left_right
_image_random_flip_top_bottom _image_random_hue _image_random_lighting _image_random_saturation
_image_resize _image_to_tensor _imdecode _lesser_equal_scalar _lesser_scalar _linalg_det
_linalg_extractdiag _linalg_extracttrian _linalg_gelqf _linalg_gemm _linalg_gemm2 _linalg_inverse
_linalg_makediag _linalg_maketrian _linalg_potrf _linalg_potri _linalg_slogdet _linalg_sumlogdiag
_linalg_syevd _linalg_syrk _linalg_trmm _linalg_trsm _logical_and_scalar _logical_or_scalar
_logical_xor_scalar _maximum_scalar _minimum_scalar _minus_scalar _mod_scalar _mul_scalar
_not_equal_scalar _np_cumsum _np_diag _np_dot _np_prod _np_sum _np_trace _np_transpose
_npi_absolute _npi_add_scalar _npi_arccos _npi_arccosh _npi_arcsin _npi_arcsinh _npi_arctan
_npi_arctan2 _npi_arctan2_scalar _npi_arctanh _npi_average _npi_cbrt _npi_ceil _npi_cholesky
_npi_cos _npi_cosh _npi_degrees _npi_eig _npi_eigh _npi_eigvals _npi_eigvalsh _npi_einsum
_npi_equal_scalar _npi_exp _npi_expm1 _npi_fix _npi_floor _npi_greater_equal_scalar
_npi_greater_scalar _npi_hypot _npi_ldexp _npi_ldexp_scalar _npi_less_equal_scalar _npi_less_scalar
_npi_log _npi_log10 _npi_log1p _npi_log2 _npi_logical_not _npi_matmul _npi_mean
_npi_multiply_scalar _npi_negative _npi_norm _npi_not_equal_scalar _npi_percentile _npi_pinv
_npi_pinv_scalar_rcond _npi_polyval _npi_power _npi_power_scalar _npi_powerd _npi_radians
_npi_rarctan2_scalar _npi_reciprocal _npi_rint _npi_rldexp_scalar _npi_rpower_scalar
_npi_rsubtract_scalar _npi_sign _npi_sin _npi_sinh _npi_solve _npi_sqrt _npi_square _npi_std
_npi_subtract_scalar _npi_svd _npi_tan _npi_tanh _npi_tensordot _npi_tensordot_int_axes
_npi_tensorinv _npi_tensorsolve _npi_trunc _npi_var _npx_sigmoid _onehot_encode
_plus_scalar _power _power_scalar _ravel_multi_index _rdiv_scalar _rminus_scalar _rmod_scalar
_rnn_param_concat _rpower_scalar _scatter_minus_scalar _scatter_plus_scalar _scatter_set_nd
_sg_mkldnn_conv _sg_mkldnn_fully_connected _slice_assign _slice_assign_scalar _sparse_retain
_split_v2 _square_sum _unravel_index abs all_finite arccos arccosh arcsin arcsinh arctan arctanh
argmax_channel argsort batch_take broadcast_hypot broadcast_mul broadcast_power cast_storage cbrt
ceil clip cos cosh degrees depth_to_space diag erf erfinv exp expm1 fill_element_0index fix floor
gamma gammaln gather_nd hard_sigmoid khatri_rao log log10 log1p log2 log_softmax logical_not
make_loss mean moments nanprod nansum negative norm one_hot prod radians rcbrt reciprocal
reshape_like reverse rint round rsqrt scatter_nd shape_array sigmoid sign sin sinh size_array
smooth_l1 softmax softmax_cross_entropy softmin softsign sort space_to_depth sqrt square sum tan
tanh topk transpose trunc
""".split() + common.CONTROL_FLOW

# Run in float32 only when the attribute takes one of the values; otherwise neutral.
# LeakyReLU prelu/rrelu: MXNet 1.9.1's CPU build has no bfloat16 kernel for them ("Unknown
# type enum 12"), so after a bfloat16 convolution they must get float32 inputs.
CONDITIONAL_FP32 = (
    ("Activation", "act_type", ("softrelu",)),
    ("LeakyReLU", "act_type", ("elu", "selu", "prelu", "rrelu")),
)

# Low-precision ops that run in float32 when their data input is narrower than an attribute:
# (op, attribute) -- float32 when the input's width (last spatial axis) is smaller than the
# attribute's last value. Convolution and its stride: oneDNN 2.4's bfloat16 weight-gradient
# kernel splits the width into stride phases and leaves the padding of a phase that holds no
# input column unwritten, then reads it: the gradient of the taps that only see padding gets
# whatever that memory held (garbage, often NaN or inf). Such convolutions are tiny (a map of a
# few pixels), so float32 costs nothing measurable. See docs/training.md.
FP32_WHEN_NARROWER = (
    ("Convolution", "stride"),
)

# Low-precision ops that run in float32 where one output map (one image, one channel; 1-, 2- or
# 3-d) has one of these pixel counts: (op, kernel size and stride on every axis, None for any,
# input channels' multiple, only a plain op: no group, padding or dilation, pixel counts).
# Convolution: oneDNN 2.4.4's AMX bfloat16 kernel (``jit:avx512_core_amx_bf16``) writes past its
# buffers for a plain 1x1, stride-1 kernel at these output sizes, whatever the batch, the rank
# (Conv1D, Conv2D, Conv3D), the map's shape or the threads, where the input channels are a
# multiple of 32: the process dies (heap corruption or a segmentation fault). GluonCV's ResNets
# at 256x192 (an 8x6 last stage) meet it, and a Conv1D on 27-48 steps. Measured by generated
# scans, one convolution per process: maps of 1-1012 pixels, 1-d lengths 1-100, 3-d maps, 3x3,
# strided, grouped, padded and dilated kernels, channels 3-2048, batches 1-8, backward
# (docs/speed.md, "A kernel that crashes on AMX"). It also needs output channels a multiple of
# 16 (24 and 40 run); the rule does not ask it, as such layers are rare. A fact of MXNet's
# kernel, not of the host: a plan typed here can also run on an AMX host.
FP32_AT_OUTPUT_PIXELS = (
    ("Convolution", 1, 1, 32, True, (27, 33, 36, 39, 42, 45, 48)),
)

# Low-precision ops that run in float32 where their data input has an odd number of channels
# below this one, and the op no group: (op, bound, spatial ranks). Convolution: oneDNN 2.4.4's bfloat16
# convolution on AVX512-BF16 (Zen 4, Xeons without AMX) runs a GEMM on plain arrays for such
# channel counts (an image's 3, a grayscale map's 1), in inference and training alike, where its
# float32 kernel blocks them; the batch norm after it then runs oneDNN's reference kernel, and
# the pooling's backward a plain one. SSD-512's first convolution, its batch norm and pooling
# (batch 8): 984 ms a training step in bfloat16, 281 in float32; the whole step 9.8 s against
# 8.0 s with them in float32. Measured by scans of channel counts 1-96 (kernels chosen, 1-, 2-
# and 3-d; training time of a convolution, batch norm and pooling): docs/speed.md, "A first
# convolution on an image's channels". Such convolutions are a network's first, a few per cent
# of its work. A fact of MXNet's kernels: a plan typed here runs the same way elsewhere. Images
# and videos only (2-d, 3-d): a sequence's first Conv1D (WaveNet's, on 1 channel) feeds a
# residual stream, not a batch norm, and in float32 its value rode every block's sum, with casts
# around each block's convolutions: WaveNet trained at 0.75x the peer (docs/speed.md).
FP32_WITH_ODD_CHANNELS_BELOW = (
    ("Convolution", 16, (2, 3)),
)

# Widest ops that run in float32 where they have more inputs than this: (op, inputs). add_n:
# oneDNN 2.4.4's bfloat16 sum kernel (``jit_bf16_sum``) takes at most 8 inputs; with more, oneDNN
# falls back to its reference sum, a reorder per input. Measured on an AMX Xeon, 16 Conv1D outputs
# of (32, 64, 512): 206 ms in bfloat16, 9.4 ms in float32; 8 of them 0.9 against 6.2 ms, so up to
# 8 inputs bfloat16 stays. A WaveNet's skip sum over 16 blocks met it: 215-245 ms a step of about
# 1,000 (docs/speed.md, "A sum of more than 8"). A fact of MXNet's kernels, not of the host.
FP32_WITH_MORE_INPUTS_THAN = (
    ("add_n", 8),
)

# Ops whose kernel in the target is slow, and the op (with these attributes) that computes the
# same where all inputs have one shape, with a fast kernel: (op, twin, twin's attributes). MXNet
# 1.9.1's numpy add and broadcast_add have no oneDNN kernel (their bfloat16 loops ran 7.6x and
# 15.6x slower than float32 with its casts: lists/kernel_speed_measured_*), nor relu, the op, and
# its numpy twin (8.5x), so the table runs them float32; elemwise_add's bfloat16 kernel is
# oneDNN's sum, which fuses into the convolution before it, and Activation's is oneDNN's eltwise.
# Where a graph is bound, such an op fed values of one shape from bfloat16 ops runs as its twin,
# in bfloat16 (gluon_amp_core/same_shape.py): d2l's `npx.relu(Y + X)`; a numpy-mode ResNet-50
# conversion, batch 8, 409 -> 292 ms. Used only where the kernel verdicts still find the op slow
# and its twin not.
SAME_SHAPE_TWINS = (
    ("_npi_add", "elemwise_add", ()),
    ("broadcast_add", "elemwise_add", ()),
    ("_npx_relu", "Activation", (("act_type", "relu"),)),
    ("relu", "Activation", (("act_type", "relu"),)),
)

# Run in the widest float type among the inputs.
WIDEST = common.WIDEST + """
_contrib_MultiBoxDetection _contrib_MultiBoxPrior _contrib_MultiBoxTarget
""".split()

# Run in whatever they are given (no tensor inputs, gradients, optimizer updates, data movement).
NEUTRAL = common.NEUTRAL + """
LRN _npx_reshape
_npi_around
""".split()

KEEP_FP32_INPUTS = common.KEEP_FP32_INPUTS
