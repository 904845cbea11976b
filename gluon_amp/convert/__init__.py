"""Mixed-precision conversion of trained FP32 networks for inference."""
from .api import convert_hybrid_block, convert_model, convert_symbol, convert_with_policy

__all__ = ["convert_symbol", "convert_model", "convert_hybrid_block", "convert_with_policy"]
