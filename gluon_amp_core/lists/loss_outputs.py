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

#: Graph outputs whose backward starts from their own attributes, not from a head gradient:
#: the loss outputs above, plus the loss ops that have no ``grad_scale`` to put a scale in.
#: A Module's dynamic loss scale reaches them through their data input (``loss_heads.py``).
GRAPH_LOSS_HEADS = LOSS_OUTPUT_FUNCTIONS + (
    "MakeLoss",
    "make_loss",
    "SVMOutput",
)
