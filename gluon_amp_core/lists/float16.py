"""Op classes for target dtype float16.

GPU through cuDNN/cuBLAS. GEMM-like ops run in float16; reductions, exponentials and
losses run in float32; element-wise ops with several inputs take the widest input type.

Data only: ``gluon_amp_core.table`` validates it against the registry.
"""
from . import common

# Run in float16: every float input is cast to it.
LOW_PRECISION = """
Convolution Deconvolution FullyConnected RNN
""".split()

# Run in float32: every float input is cast to float32 (``_npi_around``: MXNet 1.9.1 refuses
# float16 input, "Do not support float16 as input").
FP32 = """
CTCLoss Convolution_v1 Custom GroupNorm IdentityAttachKLSparseReg InstanceNorm L2Normalization
LRN LayerNorm LinearRegressionOutput LogisticRegressionOutput MAERegressionOutput MakeLoss
SVMOutput SoftmaxActivation SoftmaxOutput _NDArray _Native _contrib_DeformableConvolution
_contrib_DeformablePSROIPooling _contrib_ModulatedDeformableConvolution
_contrib_MultiBoxDetection _contrib_MultiBoxPrior _contrib_MultiBoxTarget _contrib_RROIAlign
_contrib_SyncBatchNorm _contrib_allclose _contrib_box_decode _contrib_box_encode
_contrib_count_sketch _contrib_fft _contrib_hawkesll _hypot _hypot_scalar _linalg_det
_linalg_extractdiag _linalg_extracttrian _linalg_gelqf _linalg_gemm _linalg_gemm2
_linalg_inverse _linalg_makediag _linalg_maketrian _linalg_potrf _linalg_potri _linalg_slogdet
_linalg_sumlogdiag _linalg_syevd _linalg_syrk _linalg_trmm _linalg_trsm _np_cumsum _np_dot
_np_prod _np_sum _np_trace _npi_arccos _npi_arccosh _npi_arcsin _npi_arcsinh _npi_arctan
_npi_arctan2 _npi_arctan2_scalar _npi_arctanh _npi_around _npi_average _npi_cbrt _npi_cholesky _npi_cos
_npi_cosh _npi_degrees _npi_eig _npi_eigh _npi_eigvals _npi_eigvalsh _npi_einsum _npi_exp
_npi_expm1 _npi_hypot _npi_ldexp _npi_ldexp_scalar _npi_log _npi_log10 _npi_log1p _npi_log2
_npi_matmul _npi_mean _npi_norm _npi_percentile _npi_pinv _npi_pinv_scalar_rcond _npi_polyval
_npi_power _npi_power_scalar _npi_powerd _npi_radians _npi_rarctan2_scalar _npi_reciprocal
_npi_rldexp_scalar _npi_rpower_scalar _npi_sin _npi_sinh _npi_solve _npi_std _npi_svd _npi_tan
_npi_tensordot _npi_tensordot_int_axes _npi_tensorinv _npi_tensorsolve _npi_var _power
_power_scalar _rdiv_scalar _rpower_scalar _square_sum arccos arcsin arctanh argsort
broadcast_hypot broadcast_power cosh erfinv exp expm1 gamma gammaln khatri_rao log log10 log1p
log2 log_softmax make_loss mean moments nanprod nansum norm prod rcbrt reciprocal rsqrt sinh
smooth_l1 softmax softmax_cross_entropy softmin square sum tan topk
""".split() + common.CONTROL_FLOW

# Run in float32 only when the attribute takes one of the values; otherwise neutral.
CONDITIONAL_FP32 = (
    ("Activation", "act_type", ("softrelu",)),
    ("LeakyReLU", "act_type", ("elu", "selu")),
)

# Low-precision ops that run in float32 when their data input is narrower than an attribute
# (see the bfloat16 list): none for float16.
FP32_WHEN_NARROWER: tuple = ()
FP32_AT_OUTPUT_PIXELS: tuple = ()
FP32_WITH_ODD_CHANNELS_BELOW: tuple = ()
FP32_WITH_MORE_INPUTS_THAN: tuple = ()
# Slow ops run as a same-shape twin (see the bfloat16 list): none for float16.
SAME_SHAPE_TWINS: tuple = ()

# Run in the widest float type among the inputs.
WIDEST = common.WIDEST + """
_contrib_interleaved_matmul_encdec_qk _contrib_interleaved_matmul_encdec_valatt
_contrib_interleaved_matmul_selfatt_qk _contrib_interleaved_matmul_selfatt_valatt broadcast_mul
""".split()

# Run in whatever they are given (no tensor inputs, gradients, optimizer updates, data movement).
NEUTRAL = common.NEUTRAL + """
BatchNorm_v1 BilinearSampler Crop Dropout Embedding GridGenerator Pad Pooling_v1 ROIPooling
SequenceLast SequenceMask SequenceReverse SpatialTransformer SwapAxis UpSampling _CustomFunction
_contrib_BilinearResize2D _contrib_SparseEmbedding _contrib_bipartite_matching
_contrib_boolean_mask _contrib_dequantize _contrib_div_sqrt_dim _contrib_getnnz
_contrib_gradientmultiplier _contrib_ifft _contrib_index_array _contrib_index_copy
_contrib_quadratic _contrib_quantize _contrib_quantize_v2 _contrib_quantized_act
_contrib_quantized_concat _contrib_quantized_conv _contrib_quantized_elemwise_add
_contrib_quantized_flatten _contrib_quantized_fully_connected _contrib_quantized_pooling
_contrib_requantize _copyto _cvcopyMakeBorder _cvimdecode _cvimresize _div_scalar _equal_scalar
_grad_add _greater_equal_scalar _greater_scalar _histogram _identity_with_attr_like_rhs
_image_adjust_lighting _image_crop _image_flip_left_right _image_flip_top_bottom _image_normalize
_image_random_brightness _image_random_color_jitter _image_random_contrast
_image_random_flip_left_right _image_random_flip_top_bottom _image_random_hue
_image_random_lighting _image_random_saturation _image_resize _image_to_tensor _imdecode
_lesser_equal_scalar _lesser_scalar _logical_and_scalar _logical_or_scalar _logical_xor_scalar
_maximum_scalar _minimum_scalar _minus_scalar _mod_scalar _mul_scalar _not_equal_scalar _np_diag
_np_transpose _npi_absolute _npi_add_scalar _npi_ceil _npi_equal_scalar _npi_fix _npi_floor
_npi_greater_equal_scalar _npi_greater_scalar _npi_less_equal_scalar _npi_less_scalar
_npi_logical_not _npi_multiply_scalar _npi_negative _npi_not_equal_scalar _npi_rint
_npi_rsubtract_scalar _npi_sign _npi_sqrt _npi_square _npi_subtract_scalar _npi_tanh _npi_trunc
_npx_reshape _npx_sigmoid _onehot_encode _plus_scalar _ravel_multi_index _rminus_scalar
_rmod_scalar _rnn_param_concat _scatter_minus_scalar _scatter_plus_scalar _scatter_set_nd
_sg_mkldnn_conv _sg_mkldnn_fully_connected _slice_assign _slice_assign_scalar _sparse_retain
_split_v2 _unravel_index abs all_finite arccosh arcsinh arctan argmax_channel batch_take
cast_storage cbrt ceil clip cos degrees depth_to_space diag erf fill_element_0index fix floor
gather_nd hard_sigmoid logical_not negative one_hot radians reshape_like reverse rint round
scatter_nd shape_array sigmoid sign sin size_array softsign sort space_to_depth sqrt tanh transpose
trunc
""".split()

KEEP_FP32_INPUTS = common.KEEP_FP32_INPUTS
