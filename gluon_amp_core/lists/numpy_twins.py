"""Numpy-frontend ops and their legacy twins. Data only.

Code written for MXNet's numpy mode (``npx.set_np()``: d2l, Gluon layers under it) runs the
second op of each pair where legacy code runs the first: the same kernel under another name.
A block must get one plan in either mode, so each dtype's lists class a twin as its legacy op
(``tests/core/test_numpy_twins.py``), except where the pair is listed apart below, with why.

bfloat16's element-wise twins outside oneDNN are float32, as their legacy ops: their bfloat16
loops measured 2.8-24x slower than float32 on a 2-core Xeon with ``avx512_bf16`` (tanh 2.8x,
``x * 1.5`` 24x, abs 14x, square 19x; docs/speed.md), the same as the legacy ops'.
"""

#: (legacy op, numpy-frontend op): the same kernel (``_npi_gamma`` is a sampler, not ``gamma``)
TWINS = (
    ("Concat", "_npi_concatenate"), ("_arange", "_npi_arange"), ("_copy", "_np_copy"),
    ("_div_scalar", "_npi_true_divide_scalar"), ("_equal", "_npi_equal"),
    ("_equal_scalar", "_npi_equal_scalar"), ("_eye", "_npi_eye"), ("_greater", "_npi_greater"),
    ("_greater_equal", "_npi_greater_equal"),
    ("_greater_equal_scalar", "_npi_greater_equal_scalar"),
    ("_greater_scalar", "_npi_greater_scalar"), ("_hypot", "_npi_hypot"),
    ("_lesser_equal_scalar", "_npi_less_equal_scalar"), ("_lesser_scalar", "_npi_less_scalar"),
    ("_minus_scalar", "_npi_subtract_scalar"), ("_mod", "_npi_mod"),
    ("_mod_scalar", "_npi_mod_scalar"), ("_mul_scalar", "_npi_multiply_scalar"),
    ("_not_equal", "_npi_not_equal"), ("_not_equal_scalar", "_npi_not_equal_scalar"),
    ("_ones", "_npi_ones"), ("_plus_scalar", "_npi_add_scalar"), ("_power", "_npi_power"),
    ("_power_scalar", "_npi_power_scalar"), ("_rdiv_scalar", "_npi_rtrue_divide_scalar"),
    ("_rminus_scalar", "_npi_rsubtract_scalar"), ("_rmod_scalar", "_npi_rmod_scalar"),
    ("_rpower_scalar", "_npi_rpower_scalar"), ("_zeros", "_npi_zeros"), ("abs", "_npi_absolute"),
    ("arccos", "_npi_arccos"), ("arccosh", "_npi_arccosh"), ("arcsin", "_npi_arcsin"),
    ("arcsinh", "_npi_arcsinh"), ("arctan", "_npi_arctan"), ("arctanh", "_npi_arctanh"),
    ("argmax", "_npi_argmax"), ("argmin", "_npi_argmin"), ("batch_dot", "_npi_matmul"),
    ("broadcast_add", "_npi_add"), ("broadcast_div", "_npi_true_divide"),
    ("broadcast_equal", "_npi_equal"), ("broadcast_greater", "_npi_greater"),
    ("broadcast_greater_equal", "_npi_greater_equal"), ("broadcast_hypot", "_npi_hypot"),
    ("broadcast_lesser", "_npi_less"), ("broadcast_lesser_equal", "_npi_less_equal"),
    ("broadcast_mod", "_npi_mod"), ("broadcast_mul", "_npi_multiply"),
    ("broadcast_not_equal", "_npi_not_equal"), ("broadcast_power", "_npi_power"),
    ("broadcast_sub", "_npi_subtract"), ("broadcast_to", "_npi_broadcast_to"),
    ("cbrt", "_npi_cbrt"), ("ceil", "_npi_ceil"), ("cos", "_npi_cos"), ("cosh", "_npi_cosh"),
    ("degrees", "_npi_degrees"), ("diag", "_np_diag"), ("dot", "_np_dot"), ("exp", "_npi_exp"),
    ("expm1", "_npi_expm1"), ("fix", "_npi_fix"), ("floor", "_npi_floor"), ("log", "_npi_log"),
    ("log10", "_npi_log10"), ("log1p", "_npi_log1p"), ("log2", "_npi_log2"),
    ("logical_not", "_npi_logical_not"), ("max", "_np_max"), ("mean", "_npi_mean"),
    ("min", "_np_min"), ("negative", "_npi_negative"), ("norm", "_npi_norm"), ("prod", "_np_prod"),
    ("radians", "_npi_radians"), ("reciprocal", "_npi_reciprocal"), ("relu", "_npx_relu"),
    ("rint", "_npi_rint"), ("sigmoid", "_npx_sigmoid"), ("sign", "_npi_sign"), ("sin", "_npi_sin"),
    ("sinh", "_npi_sinh"), ("sqrt", "_npi_sqrt"), ("square", "_npi_square"),
    ("squeeze", "_np_squeeze"), ("stack", "_npi_stack"), ("sum", "_np_sum"), ("tan", "_npi_tan"),
    ("tanh", "_npi_tanh"), ("transpose", "_np_transpose"), ("trunc", "_npi_trunc"),
    ("where", "_npi_where"),
)

#: pairs classed apart for bfloat16, with why
BFLOAT16_APART = {
    ("broadcast_mul", "_npi_multiply"): "numpy's multiply is both legacy elemwise_mul (widest type) and "
                                        "broadcast_mul; bfloat16 broadcast_mul is a slow loop",
    ("broadcast_div", "_npi_true_divide"): "no bfloat16 kernel for _npi_true_divide (its conformance verdict)",
    ("_copy", "_np_copy"): "timed apart: bfloat16 _copy 1.6-1.7x float32 with its casts, _np_copy 0.24x "
                           "(gluon_amp_core/lists/kernel_speed_measured_*.py)",
    ("broadcast_to", "_npi_broadcast_to"): "no bfloat16 backward for _npi_broadcast_to (its conformance verdict)",
    ("where", "_npi_where"): "no bfloat16 backward for _npi_where (its conformance verdict)",
}

#: pairs classed apart for float16: its lists are the peer's (MXNet's own AMP lists, for GPUs),
#: kept as they are so that a float16 plan is the one ``mxnet.contrib.amp`` makes
FLOAT16_APART = {
    pair: "the peer's float16 lists class them apart" for pair in (
        ("_rdiv_scalar", "_npi_rtrue_divide_scalar"), ("arccosh", "_npi_arccosh"), ("arcsinh", "_npi_arcsinh"),
        ("arctan", "_npi_arctan"), ("batch_dot", "_npi_matmul"), ("cbrt", "_npi_cbrt"), ("cos", "_npi_cos"),
        ("degrees", "_npi_degrees"), ("dot", "_np_dot"), ("radians", "_npi_radians"), ("sin", "_npi_sin"),
        ("square", "_npi_square"))
}
