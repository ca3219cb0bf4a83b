"""The MLP side of a decoder block (as :mod:`kvbench.layouts` is the attention side): dense SwiGLU,
routers, the mixture of experts, and a checkpoint's expert tensors as its weights."""
