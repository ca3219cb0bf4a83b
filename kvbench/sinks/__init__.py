"""Where records go once written: the console, the local report and its plots, Weights & Biases.
Sinks read records through ``kvbench.results``; they never run a model."""
