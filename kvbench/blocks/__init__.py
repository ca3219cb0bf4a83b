"""What a decoder block is made of beyond its attention and MLP: Gemma's residual stream and per-layer
inputs (residual), DeepSeek-V4's hyper-connection streams (hyper_connection) and the block that runs them
(hyper_block)."""
