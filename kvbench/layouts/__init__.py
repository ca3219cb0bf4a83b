"""The attention layout of each decoder layer, as data (:mod:`kvbench.layouts.base`).

:func:`build` makes the decoder's :class:`Layouts` once from the resolved model and attention
configs: one module per kind of layer (:mod:`~kvbench.layouts.kv_heads`: MHA/GQA/MQA, with a
window and sinks as properties; :mod:`~kvbench.layouts.latent`: MLA). Everything a kind of layer
means lives in its module; nothing else needs an ``if`` on it.
"""
