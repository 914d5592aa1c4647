"""znni: exact dense sliding-window inference of 3D ConvNets (ZNNi in Python)."""
__version__ = "0.1.0"
