"""Loss-output ops: their backward ignores the incoming gradient and uses ``grad_scale``.

``scale_loss`` multiplies the loss, i.e. the gradient flowing back into the graph; these
ops start their own backward from ``grad_scale`` instead, so a loss scale only reaches
their gradients through that attribute. Same list for every target dtype. Data only.
"""

LOSS_OUTPUT_FUNCTIONS = (
    "SoftmaxOutput",
    "LinearRegressionOutput",
    "LogisticRegressionOutput",
    "MAERegressionOutput",
)
