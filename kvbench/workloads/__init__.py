"""What a run feeds the model: one module per ``conf/workload/<name>.yaml``, each with ``run()``
and the methods of the metrics it emits."""
