"""The pure core's tests: no MXNet, no NumPy (tests/mxnet_layer/test_layers.py checks that
this directory passes with both blocked). Only puts the repository on sys.path."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
