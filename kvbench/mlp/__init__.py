"""The MLP side of a decoder block, as :mod:`kvbench.layouts` is the attention side: the dense
SwiGLU (:mod:`~kvbench.mlp.dense`), the routers (:mod:`~kvbench.mlp.router`) and the mixture of
experts (:mod:`~kvbench.mlp.experts`), and how a checkpoint's expert tensors become its weights
(:mod:`~kvbench.mlp.weights`)."""
