"""``teacher-server bench``: DESIGN's workloads against a running server (``--url``), a
checkpoint (``--model``) or a model shape with random weights (``--shape``), reported as a table
and a PNG plot of tokens/s and MFU."""
