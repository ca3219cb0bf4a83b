"""What a job does, one module per ``task=`` value, each with ``run()`` and the methods of the
metrics it emits."""
