"""Each decoder layer's attention layout as data, one module per kind of layer (K/V heads, latent,
Gated DeltaNet): everything a kind means lives in its module, so nothing else needs an ``if`` on it."""
